"""The parts of overlap that need no peers: the bucket plan, the flat buffers, the emulated
device, the tasks' entry points and the configuration's checks."""

from __future__ import annotations

import math

import pytest
import torch
from torch.nn.utils import vector_to_parameters

from gossip.config import TrainConfig
from gossip.errors import ConfigError
from gossip.overlap import FlatGrads, FlatLayout, FlatParams, plan_buckets
from gossip.overlap.buckets import MIB
from gossip.strategies.base import base_tag, bucket_tag
from gossip.tasks import create_task
from gossip.tasks.deep import build_deep_mlp, parameter_count
from gossip.tasks.emulated import emulate_device

# -- the bucket plan ---------------------------------------------------------------------


def test_buckets_follow_backward_order_and_tile_the_flat_buffer():
    numels = [300, 7, 1000, 800, 2600, 11, 90]  # a 2600-element parameter is over every cap
    plan = plan_buckets(numels, 4, bucket_mb=2000 * 4 / MIB, first_bucket_mb=100 * 4 / MIB)
    order = [i for b in plan for i in b.indices]
    assert order == list(reversed(range(len(numels))))  # each parameter once, backward order
    assert plan[0].stop == sum(numels) and plan[-1].start == 0
    for before, after in zip(plan, plan[1:]):
        assert after.stop == before.start  # contiguous slices of the forward-order buffer
    for b in plan:
        assert b.numel == sum(numels[i] for i in b.indices)
        cap = 100 if b.index == 0 else 2000
        assert b.numel <= cap or len(b.indices) == 1  # only a lone parameter may exceed it
    assert [b.indices for b in plan] == [(6,), (5,), (4,), (3, 2, 1), (0,)]
    again = plan_buckets(list(numels), 4, bucket_mb=2000 * 4 / MIB,
                         first_bucket_mb=100 * 4 / MIB)
    assert again == plan  # a pure function of the shapes: the same on every rank


def test_an_infinite_bucket_is_one_bucket_and_bad_caps_name_themselves():
    (only,) = plan_buckets([3, 4, 5], 4, bucket_mb=math.inf, first_bucket_mb=math.inf)
    assert (only.start, only.stop, only.indices) == (0, 12, (2, 1, 0))
    # The first bucket's own cap does not split it either (it did above 1 MiB).
    (only,) = plan_buckets([MIB, MIB], 4, bucket_mb=math.inf)
    assert (only.start, only.stop) == (0, 2 * MIB)
    for bad in (0, -1.0, float("nan"), True, "4"):
        with pytest.raises(ConfigError, match="bucket_mb must be a positive number"):
            plan_buckets([3], 4, bucket_mb=bad)


# -- persistent flat buffers -------------------------------------------------------------


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(5, 3), torch.nn.Tanh(), torch.nn.Linear(3, 2))


def test_flat_params_are_views_and_survive_a_rebinding_from_outside():
    model = _model()
    params = list(model.parameters())
    values = [p.detach().clone() for p in params]
    flat = FlatParams(FlatLayout(params))
    assert torch.equal(flat.flat, torch.cat([v.reshape(-1) for v in values]))
    with torch.no_grad():
        flat.flat.mul_(2)
    assert torch.equal(params[0], 2 * values[0])  # the parameters are the buffer
    vector_to_parameters(torch.arange(26.0), params)  # what the consensus probe does
    assert not params[0].data_ptr() == flat.flat.data_ptr()
    assert torch.equal(flat.bind(), torch.arange(26.0))  # values copied back, views again
    assert params[0].data_ptr() == flat.flat.data_ptr()


def test_flat_grads_take_in_gradients_autograd_allocated_and_missing_ones():
    model = _model()
    params = list(model.parameters())
    grads = FlatGrads(FlatLayout(params))
    model(torch.ones(4, 5)).sum().backward()
    summed = grads.flat.clone()  # accumulated in place into the views
    assert summed.abs().sum() > 0
    for p in params:
        p.grad = None  # zero_grad(set_to_none=True)
    model[0](torch.ones(4, 5)).sum().backward()  # the last layer gets no gradient
    flat = grads.bind()
    assert torch.equal(flat[:18], torch.cat([params[0].grad.reshape(-1), params[1].grad]))
    assert torch.equal(flat[18:], torch.zeros(8))
    assert all(p.grad.data_ptr() >= flat.data_ptr() for p in params)


# -- tasks and the emulated device -------------------------------------------------------


def test_deep_mlp_size_and_depth_are_options():
    model = build_deep_mlp(64, 5)
    linear = [m for m in model if isinstance(m, torch.nn.Linear)]
    assert len(linear) == 5
    assert sum(p.numel() for p in model.parameters()) == parameter_count(64, 5)
    assert parameter_count(512, 6) > 1_000_000  # the default is of realistic size
    with pytest.raises(ConfigError, match="deep-mlp: depth must be an integer"):
        create_task("deep-mlp", depth=1)
    with pytest.raises(ConfigError, match="task 'deep-mlp'.*unexpected keyword"):
        create_task("deep-mlp", colour="red")


def test_emulated_device_sleeps_e_per_layer_forward_and_2e_backward():
    slept: list[float] = []
    model = _model()
    emulate_device(model, 0.25, slept.append)
    out = model(torch.ones(2, 5)).sum()
    assert slept == [0.25, 0.25]  # two layers with parameters
    out.backward()
    assert slept == [0.25, 0.25, 0.5, 0.5]
    with torch.no_grad():  # evaluation runs at full speed
        model(torch.ones(2, 5))
    assert len(slept) == 4


@pytest.mark.parametrize("task, culprit", [
    ("no_such_module_xyz:factory", "task 'no_such_module_xyz:factory': cannot import "
                                   "no_such_module_xyz: ModuleNotFoundError"),
    ("gossip.tasks.deep:no_such_factory", "module gossip.tasks.deep has no callable "
                                          "'no_such_factory'"),
    ("gossip.tasks.deep:", "expected package.module:factory"),
])
def test_a_bad_task_path_is_one_line_naming_it(task, culprit):
    with pytest.raises(ConfigError) as caught:
        TrainConfig(task=task)
    assert culprit in str(caught.value) and "\n" not in str(caught.value)


def test_a_users_task_factory_is_imported_with_its_options():
    task = create_task("gossip.tasks.deep:deep_mlp_task", seed=1, width=32, depth=4)
    assert task.name == "deep-mlp"
    with pytest.raises(ConfigError, match="returned dict, not a gossip.tasks.Task"):
        create_task("builtins:dict", seed=1)


# -- configuration -----------------------------------------------------------------------


def test_overlap_with_a_strategy_that_ends_rounds_at_run_time_is_a_config_error():
    with pytest.raises(ConfigError, match="overlap: True with strategy nonblocking: it "
                                          "decides at run time"):
        TrainConfig(strategy="nonblocking", options={"inner": "dpsgd"}, overlap=True)
    with pytest.raises(ConfigError, match="overlap: True with strategy local: it plans each"):
        TrainConfig(strategy="local", options={"period": 8}, overlap=True)
    TrainConfig(strategy="dpsgd", overlap=True)  # its combine point is fixed
    for field, value in (("bucket_mb", 0.0), ("overlap", "yes"), ("layer_delay", -1.0)):
        with pytest.raises(ConfigError, match=field):
            TrainConfig(**{field: value})
    config = TrainConfig(overlap=True, bucket_mb=math.inf, task="deep-mlp",
                         task_options={"width": 32})
    assert TrainConfig.from_dict(config.to_dict()) == config


# -- the experiment's table --------------------------------------------------------------


def test_the_overlap_table_pairs_arms_and_applies_the_time_model(tmp_path):
    import json

    import yaml

    from gossip.experiment.overlap import DROP, overlap_rows

    def run(name, overlap, compute, comm, iter_s=None, exposed=None):
        path = tmp_path / name
        path.mkdir()
        (path / "config.yaml").write_text(yaml.safe_dump({"train": {"strategy": "dpsgd"}}))
        lines = []
        for round in range(DROP + 3):
            line = {"round": round, "compute_s": compute if round >= DROP else 99.0,
                    "comm_s": comm}
            if overlap:
                line.update(iter_s=iter_s, exposed_comm_s=exposed, comm_busy_s=comm,
                            buckets=1)
            lines.append(json.dumps(line))
        (path / "peer-0.jsonl").write_text("\n".join(lines) + "\n")
        return path

    dirs = [run("g-sync-1", False, 0.3, 0.2), run("g-overlap-1", True, 0.3, 0.01, 0.35, 0.05),
            run("g-sync-2", False, 0.3, 0.2), run("lonely-sync", False, 1.0, 1.0),
            run("not-an-arm", False, 1.0, 1.0)]
    (row,) = overlap_rows(dirs)
    assert row["group"] == "g" and row["on"] == "params"
    assert row["sync iter_s"] == pytest.approx(0.5)  # the first DROP rounds left out
    assert row["speedup"] == pytest.approx(0.5 / 0.35)
    assert row["predicted"] == pytest.approx(0.5 / 0.3)  # (C + M) / max(C, M)
    assert row["hidden"] == pytest.approx((0.5 - 0.35) / 0.2)  # of min(C, M)
    assert row["rounds"] == "6/3"


def test_a_second_backward_into_a_sent_bucket_is_an_error_not_a_race():
    from gossip.peer import Peer
    from gossip.topology import Topology
    from gossip.transport import LoopbackHub

    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    transport = LoopbackHub(1).transport(0, timeout=5)
    with Peer(0, Topology.generate("complete", 1), "ring-allreduce",
              transport=transport) as peer:
        peer.attach(model, bucket_mb=40 / MIB)  # a bucket per parameter
        model(torch.ones(2, 5)).sum().backward()
        with pytest.raises(ConfigError, match="inside peer.no_sync"):
            model(torch.ones(2, 5)).sum().backward()
        peer.step(model, optimizer)  # what was sent is waited for; the next step is clean
        with peer.no_sync():
            model(torch.ones(2, 5)).sum().backward()
        model(torch.ones(2, 5)).sum().backward()
        peer.step(model, optimizer, minibatches=2)
        with pytest.raises(ConfigError, match=r"step\(minibatches=3\), but the attached "
                                              r"model ran 1 training forward"):
            model(torch.ones(2, 5)).sum().backward()
            peer.step(model, optimizer, minibatches=3)


def test_bucket_tags_name_their_base_instance():
    assert bucket_tag("ps", 3) == "ps.b3" and base_tag("ps.b3") == "ps"
    assert base_tag("ps") == "ps" and base_tag("ring.b12") == "ring"
    assert base_tag("ps.bx") == "ps.bx" and base_tag("a.b1.c") == "a.b1.c"


def test_the_plain_and_overlap_steppers_do_every_stepper_operation():
    # Peer holds one stepper and asks it, never which mode it is in: a stepper missing an
    # operation would fail only in the mode that uses it.
    from gossip.overlap import Overlap
    from gossip.stepping import LocalStep, Stepper

    operations = {name for name in vars(Stepper) if not name.startswith("_")}
    assert {"attach", "busy", "step", "stop_requested", "no_sync", "close"} <= operations
    for stepper in (LocalStep, Overlap):
        assert operations <= set(dir(stepper)), operations - set(dir(stepper))
