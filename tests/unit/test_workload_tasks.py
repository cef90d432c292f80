"""The tasks of real shape: ``resnet`` (ResNet-18 of the CIFAR layout) and ``gpt`` (a byte
GPT on the interpreter's stdlib), their metrics, and what refuses a task without labels."""

from __future__ import annotations

import hashlib
import math
import platform
import sysconfig
from pathlib import Path

import numpy as np
import pytest
import torch

from gossip.attacks import Attacks
from gossip.clock import ManualClock
from gossip.cli.summary import run_summary
from gossip.config import TrainConfig
from gossip.errors import ConfigError
from gossip.metrics import MetricsWriter
from gossip.peer import Peer
from gossip.tasks import Split, Task, create_task, evaluate, partition
from gossip.tasks.gpt import (EXCLUDED, SIZES, ByteGPT, is_test_file, parameter_count,
                              stdlib_corpus, stdlib_files, windows)
from gossip.tasks.resnet import build_resnet18, draw_shapes
from gossip.threads import intra_op_threads
from gossip.topology import Topology
from gossip.training.records import Record
from gossip.training.synchronous import train
from gossip.transport import LoopbackHub


@pytest.fixture(autouse=True)
def one_thread():
    """One intra-op thread, as a launched peer has: two on a loaded 2-core machine made a
    step 15x slower."""
    with intra_op_threads(1):
        yield


def count(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


@pytest.fixture(scope="module")
def gpt() -> Task:
    return create_task("gpt", ctx=32, test_windows=8)


@pytest.fixture(scope="module")
def resnet() -> Task:
    return create_task("resnet", width=0.125, train_images=256, test_images=64)


# --- the models' sizes ---------------------------------------------------------------------


@pytest.mark.parametrize("width, parameters", [(1.0, 11_173_962), (0.25, 701_466),
                                               (0.125, 176_402)])
def test_resnet18_has_the_parameters_of_its_width(width, parameters):
    assert count(build_resnet18(width)) == parameters


@pytest.mark.parametrize("size", SIZES)
def test_gpt_has_the_formulas_parameters_plus_its_final_layernorm(size):
    d, layers, heads, ctx = SIZES[size]
    model = ByteGPT(d, layers, heads, ctx)
    spec = layers * (12 * d * d + 13 * d) + (256 + ctx) * d  # workloads.md section 3
    assert count(model) == parameter_count(d, layers, ctx) == spec + 2 * d
    assert round(count(model) / 1e6, 2) == {"small": 0.84, "full": 14.39}[size]


def test_the_full_sizes_build_and_take_a_step():
    torch.manual_seed(0)
    for model, x, y, loss_fn in (
            # small inputs: a step of each, not a benchmark
            (build_resnet18(1.0), torch.randn(2, 3, 16, 16), torch.tensor([1, 7]),
             torch.nn.functional.cross_entropy),
            (ByteGPT(*SIZES["full"]), torch.randint(0, 256, (1, 16), dtype=torch.uint8),
             torch.randint(0, 256, (1, 16), dtype=torch.uint8),
             create_task("gpt", size="full", test_windows=1).loss_fn)):
        before = [p.detach().clone() for p in model.parameters()]
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
        loss_fn(model(x), y).backward()
        optimizer.step()
        assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters()))


# --- training: the loss falls ---------------------------------------------------------------


@pytest.mark.parametrize("name", ["resnet", "gpt"])
def test_a_few_steps_lower_the_loss(name, resnet, gpt):
    task = {"resnet": resnet, "gpt": gpt}[name]
    torch.manual_seed(0)
    model = task.build_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    x, y = task.train.x[:16], task.train.y[:16]
    losses = []
    for _ in range(8):
        optimizer.zero_grad()
        loss = task.loss_fn(model(x), y)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < 0.8 * losses[0], losses


# --- data -------------------------------------------------------------------------------------


def test_shapes_are_a_function_of_the_seed():
    a, b, c = (draw_shapes(50, size=16, seed=s) for s in ((0, 0), (0, 0), (1, 0)))
    assert all(np.array_equal(u, v) for u, v in zip(a, b))
    assert not np.array_equal(a[0], c[0])
    assert a[0].shape == (50, 3, 16, 16) and a[0].dtype == np.float32
    assert np.bincount(a[1]).tolist() == [5] * 10  # balanced
    one = create_task("resnet", seed=3, train_images=100, test_images=10)
    again = create_task("resnet", seed=3, train_images=100, test_images=10)
    assert torch.equal(one.train.x, again.train.x) and torch.equal(one.test.y, again.test.y)
    assert not torch.equal(one.train.x[:10], one.test.x)  # train and test streams differ


def test_digits_upscaled_to_three_channels():
    task = create_task("resnet", data="digits", size=32)
    assert task.train.x.shape[1:] == (3, 32, 32) and len(task.train) == 1437
    assert torch.equal(task.train.x[:, 0], task.train.x[:, 2])


def test_the_lm_text_follows_the_split_rule(gpt):
    files = stdlib_files()
    assert files == sorted(files) and len(files) > 100
    assert not any(set(f.split("/")[:-1]) & EXCLUDED for f in files)
    assert not any(part.startswith("config-") for f in files for part in f.split("/")[:-1])
    test = [f for f in files if is_test_file(f)]
    assert all(hashlib.sha256(f.encode()).digest()[0] % 10 == 0 for f in test)
    assert 0.05 < len(test) / len(files) < 0.15
    corpus = stdlib_corpus()
    assert int(corpus["files"]) == len(files) and int(corpus["test_files"]) == len(test)
    root = Path(sysconfig.get_paths()["stdlib"])
    sizes = {f: (root / f).stat().st_size for f in files}
    assert corpus["test"].numel() == sum(sizes[f] for f in test)
    assert corpus["train"].numel() == sum(sizes.values()) - corpus["test"].numel()
    assert gpt.metadata["python"] == platform.python_version()
    assert len(gpt.metadata["manifest_sha256"]) == 64


def test_windows_predict_the_next_byte():
    text = torch.arange(23, dtype=torch.uint8)
    split = windows(text, 5)
    assert len(split) == 4
    assert torch.equal(split.x[1], text[5:10]) and torch.equal(split.y[1], text[6:11])


# --- metrics ----------------------------------------------------------------------------------


def test_the_lm_reports_loss_perplexity_and_next_byte_accuracy(gpt):
    torch.manual_seed(0)
    model = gpt.build_model()
    loss, accuracy = evaluate(model, gpt.test, gpt.loss_fn, batch_size=64)  # 2 windows a pass
    logits = model(gpt.test.x)
    assert loss == pytest.approx(gpt.loss_fn(logits, gpt.test.y).item(), rel=1e-5)
    assert accuracy == (logits.argmax(-1) == gpt.test.y).float().mean().item()
    assert abs(loss - math.log(256)) < 0.2  # untrained: about uniform
    assert gpt.scores(loss, accuracy) == {"test_loss": loss, "perplexity": math.exp(loss),
                                          "accuracy": accuracy}


def test_a_classifier_reports_accuracy_only(resnet):
    assert resnet.scores(0.5, 0.75) == {"accuracy": 0.75}
    with pytest.raises(ConfigError, match="metrics must include accuracy"):
        Task("t", resnet.train, resnet.test, 10, lambda: None, metrics=("bleu", "accuracy"))


def test_records_and_the_summary_show_loss_and_perplexity(tmp_path):
    base = dict(round=0, time=1.0, wall=0.0, loss=2.0, bytes_sent=10, bytes_recv=10,
                compute_s=0.1, delay_s=0.0, comm_s=0.1, wait_s=0.0, minibatches=1, samples=8)
    assert "test_loss" not in Record(accuracy=0.5, **base).as_dict()
    for rank in range(2):
        with MetricsWriter(tmp_path / f"peer-{rank}.jsonl") as metrics:
            metrics.write(Record(accuracy=0.3, test_loss=2.0, perplexity=math.exp(2.0),
                                 **base).as_dict())
    text = run_summary(tmp_path, [0, 1])
    assert "perplexity" in text.splitlines()[0] and "test loss" in text.splitlines()[0]
    assert "mean test loss 2.0000 nats per target (perplexity 7.389" in text


def test_a_trained_language_model_records_its_loss_and_perplexity():
    config = TrainConfig(strategy="dpsgd", task="gpt", rounds=2, batch_size=4, lr=0.05,
                         task_options={"ctx": 16, "test_windows": 2})
    transport = LoopbackHub(1).transport(0, clock=ManualClock(), timeout=10)
    lines = []
    with Peer(0, Topology.generate("complete", 1), "dpsgd", transport=transport) as peer:
        train(peer, config, on_round=lines.append)
    assert [line["round"] for line in lines] == [0, 1]
    assert all(line["perplexity"] == math.exp(line["test_loss"]) for line in lines)


# --- refusals ---------------------------------------------------------------------------------


@pytest.mark.parametrize("name, options, culprit", [
    ("resnet", {"width": 0}, "task resnet: width must be in [1/64, 4], got 0"),
    ("resnet", {"size": 20}, "task resnet: size must be one of 16, 32, got 20"),
    ("resnet", {"data": "cifar"}, "task resnet: data must be one of shapes, digits"),
    ("resnet", {"depth": 3}, "task 'resnet': .*unexpected keyword argument 'depth'"),
    ("gpt", {"size": "huge"}, "task gpt: size must be one of small, full, got 'huge'"),
    ("gpt", {"ctx": 4}, "task gpt: ctx must be in [8, 4096], got 4"),
    ("gpt", {"test_windows": 0}, "task gpt: test_windows must be >= 1"),
])
def test_bad_options_are_one_line_errors(name, options, culprit):
    with pytest.raises(ConfigError, match=culprit.replace("[", r"\[").replace("]", r"\]")) as err:
        create_task(name, **options)
    assert "\n" not in str(err.value)


def test_a_task_without_labels_refuses_what_needs_them(gpt):
    with pytest.raises(ConfigError, match="partition: 'dirichlet' splits by class label, and "
                                          "task gpt's examples have none"):
        TrainConfig(task="gpt", partition="dirichlet")
    with pytest.raises(ConfigError, match="attack: '1:labelflip' changes class labels"):
        TrainConfig(task="gpt", strategy="dpsgd", attack=Attacks.parse("1:labelflip"))
    TrainConfig(task="gpt", strategy="dpsgd", attack=Attacks.parse("1:signflip"))  # fine
    with pytest.raises(ConfigError, match="dirichlet splits by class label"):
        partition(gpt.train.y, 2, scheme="dirichlet")
    shards = partition(gpt.train.y, 3, scheme="iid")
    assert sum(s.size for s in shards) == len(gpt.train)


def test_a_split_of_bytes_is_a_split():
    split = Split(torch.zeros(4, 3, dtype=torch.uint8), torch.ones(4, 3, dtype=torch.uint8))
    assert len(split) == 4
