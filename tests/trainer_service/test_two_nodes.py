"""The trainer on two nodes: `torchrun --nnodes 2` twice (one rank each, two "nodes" on
loopback, node 0 hosting the rendezvous store, one run directory both see, as shared storage on
a cluster). Node 1 is SIGKILLed mid-run, as a lost machine; node 0 fails with it; both are
started again, resume from the last checkpoint and finish, each batch trained exactly once."""

from __future__ import annotations

from collections import Counter

import orjson
import pytest

from centerline.nats_server import EmbeddedNats
from centerline.ports import free_port
from centerline.toy.tokenizer import VOCAB_SIZE
from tests.processes import metrics_lines, wait_until
from tests.trainer_service import service_stack
from tests.trainer_service.service_stack import StandInWorker, Trainer, write_dataset

pytestmark = [pytest.mark.integration, pytest.mark.slow]
STEPS = 5


@pytest.fixture
def stack(tmp_path, sglang, model_dir):
    yield tmp_path, model_dir, sglang
    Trainer.kill_all()


def test_a_two_node_trainer_resumes_after_losing_a_node_and_trains_each_batch_once(stack):
    tmp, model, engine = stack
    run_dir, dataset = tmp / "run", write_dataset(tmp / "tasks.jsonl")

    with EmbeddedNats(tmp / "nats") as nats, StandInWorker(nats.url, engine.url, VOCAB_SIZE) as worker:

        def two_nodes() -> list[Trainer]:
            port = free_port()
            argv = (run_dir, model, dataset, nats.url, engine.url, "--steps", str(STEPS), *service_stack.FLAGS)
            return [Trainer(*argv, nproc=1, node=(rank, 2, port)) for rank in (0, 1)]

        first = two_nodes()
        wait_until(lambda: len(metrics_lines(run_dir)) >= 2, 300, "2 steps on two nodes", first[0].proc)
        first[1].kill()  # node 1 lost: its torchrun and its rank
        assert first[0].wait(180) != 0, "node 0 went on without node 1"
        killed_after = len(metrics_lines(run_dir))
        second = two_nodes()
        codes = [trainer.wait(300) for trainer in second]
        assert codes == [0, 0], "\n".join(t.log() for t in second)
    assert worker.error is None, worker.error

    lines = metrics_lines(run_dir)
    trained = [bid for line in lines for bid in line["batch_ids"]]
    state = orjson.loads((run_dir / "checkpoints" / f"step-{STEPS:06d}" / "state.json").read_bytes())
    assert [line["step"] for line in lines] == list(range(1, STEPS + 1)) and 2 <= killed_after < STEPS
    assert len(trained) == len(set(trained)) == 2 * STEPS  # no batch trained twice, none lost
    assert set(trained) <= set(worker.published)
    assert list(state["ledger"]) == trained and Counter(entry["step"] for entry in state["ledger"].values()) == {
        s: 2 for s in range(STEPS)
    }
    assert "--nnodes" in first[0].proc.args and "--nnodes" in second[1].proc.args
