"""Federated learning prototyped on gossip as a library: 8 clients with non-IID (Dirichlet
0.3) shards of the digits task train locally for one epoch per round, then aggregate:
FedAvg (a parameter server; half the clients, drawn per round, contribute) against
serverless gossip (one D-PSGD step on a ring). Writes federated.png: accuracy vs rounds
and vs bytes.   Run: python experiments/federated.py  (about 10 s on 2 cores)"""

import copy
import sys
import threading

import matplotlib
import torch

import gossip
from gossip.ports import free_ports
from gossip.tasks import BatchStream, create_task, evaluate, partition

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402 (after choosing the backend)

CLIENTS, ROUNDS, BATCH, LR = 8, 30, 16, 0.1
task = create_task("digits", seed=0)
shards = partition(task.train.y, CLIENTS, scheme="dirichlet", alpha=0.3, seed=0)
EPOCH = len(task.train.y) // (CLIENTS * BATCH)  # local steps per round: one mean epoch
torch.manual_seed(0)
initial = task.build_model()  # every client starts from the same model
ARMS = {  # name: (servers, topology graph, local SGD's options)
    "FedAvg (server, 50% of clients per round)":
        ([0], "complete", {"inner": "ps", "inner_options": {"participation": 0.5}}),
    "serverless gossip (D-PSGD on a ring)": ([], "ring", {"inner": "dpsgd"}),
}


def run(servers, graph, options):
    size = CLIENTS + len(servers)
    topology = gossip.Topology.from_dict(
        {"size": size, "graph": {"kind": graph}, **({"servers": servers} if servers else {})}
    ).relocated(ports=free_ports(size))
    curve = [[] for _ in range(ROUNDS)]  # per round: (accuracy, bytes) of every client

    def peer_main(rank):
        with gossip.Peer(rank, topology, "local", period=EPOCH, **options) as peer:
            if rank in servers:
                return peer.serve()  # answers until every client said goodbye
            client = rank - len(servers)
            model = copy.deepcopy(initial)
            optimizer = torch.optim.SGD(model.parameters(), lr=LR)
            batches = BatchStream(task.train, shards[client], batch_size=BATCH, seed=client)
            for step in range(ROUNDS * EPOCH):
                x, y = batches.next()
                optimizer.zero_grad()
                task.loss_fn(model(x), y).backward()
                peer.step(model, optimizer)  # local step; every EPOCH-th also aggregates
                if (step + 1) % EPOCH == 0:
                    stats = peer.stats
                    accuracy = evaluate(model, task.test, task.loss_fn)[1]
                    traffic = stats["bytes_sent"] + stats["bytes_recv"]
                    curve[step // EPOCH].append((accuracy, traffic))

    threads = [threading.Thread(target=peer_main, args=(r,)) for r in range(size)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    return [(sum(a for a, _ in row) / CLIENTS, sum(b for _, b in row) / CLIENTS / 1e6)
            for row in curve]


figure, (by_round, by_bytes) = plt.subplots(1, 2, figsize=(10, 4))
for name, arm in ARMS.items():
    accuracy, megabytes = zip(*run(*arm))
    print(f"{name}: accuracy {accuracy[-1]:.3f} after {ROUNDS} rounds, "
          f"{megabytes[-1]:.2f} MB per client")
    by_round.plot(range(1, ROUNDS + 1), accuracy, label=name)
    by_bytes.plot(megabytes, accuracy, label=name)
by_round.set(xlabel="round (one local epoch each)", ylabel="mean test accuracy of the clients")
by_bytes.set(xlabel="MB sent + received per client", ylabel="mean test accuracy of the clients")
by_round.legend()
figure.savefig(sys.argv[1] if len(sys.argv) > 1 else "federated.png", dpi=100,
               bbox_inches="tight")
