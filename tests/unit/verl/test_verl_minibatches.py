"""hdp trains the mini-batches stock verl trains at the same world size (``hdp.integrations.verl.minibatches``).

Through verl's own code: the trainer's ``_balance_batch`` (v1 ``PPOTrainer`` and the legacy
``RayPPOTrainer``, patched by the plugin when they are imported) and the worker's
``TrainingWorker.train_mini_batch`` loop (``patches.own_mini_batch_loop``), each run for an hdp actor
(verl sees DP size 1) and for stock verl's D data-parallel ranks (each rank its contiguous part, as
verl's dispatch hands it), on the same batch.  The sets of samples per mini-batch must be equal; the
same batch under verl's unpatched DP-1 grouping must differ (the check can fail).
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from types import SimpleNamespace

import pytest

pytest.importorskip("verl")

import torch  # noqa: E402
from omegaconf import OmegaConf  # noqa: E402

LENGTHS = [30, 3, 17, 9, 25, 4, 12, 40, 7, 22, 5, 14]  # 12 samples of one batch, uneven workloads


def _config(strategy: str, *, tp: int = 1, pp: int = 1, mini: int = 3, n: int = 2):
    return OmegaConf.create({
        "actor_rollout_ref": {"actor": {"strategy": strategy, "ppo_mini_batch_size": mini,
                                        "megatron": {"tensor_model_parallel_size": tp,
                                                     "pipeline_model_parallel_size": pp}},
                              "rollout": {"n": n}},
        "trainer": {"critic_warmup": 0},
    })


class _Group:
    """The worker-group surface verl's ``_balance_batch`` reads: world size and the actor's dispatch info."""

    def __init__(self, ranks: list[int]) -> None:
        self.world_size = len(ranks)
        self._ranks = ranks
        self._dispatch_info: dict[str, list[int]] = {}

    def _query_dispatch_info(self, mesh: str) -> list[int]:
        return list(self._ranks)


def _legacy_order(strategy: str, ranks: list[int], *, tp: int = 1) -> list[int]:
    from verl import DataProto
    from verl.trainer.ppo.ray_trainer import RayPPOTrainer

    width = max(LENGTHS) + 2
    mask = torch.zeros(len(LENGTHS), width, dtype=torch.int64)
    for i, n in enumerate(LENGTHS):
        mask[i, :n] = 1
    batch = DataProto.from_dict({"attention_mask": mask, "sid": torch.arange(len(LENGTHS))})
    trainer = object.__new__(RayPPOTrainer)
    trainer.config, trainer.actor_rollout_wg = _config(strategy, tp=tp), _Group(ranks)
    trainer._balance_batch(batch, metrics={})
    assert trainer.actor_rollout_wg._dispatch_info["actor"] == ranks  # verl's dispatch info is left as it was
    return batch.batch["sid"].tolist()


def _v1_order(strategy: str, ranks: list[int]) -> list[int]:
    pytest.importorskip("transfer_queue")
    from transfer_queue import KVBatchMeta
    from verl.trainer.ppo.v1 import PPOTrainerSync  # main_ppo's sync trainer; _balance_batch is PPOTrainer's

    batch = KVBatchMeta(keys=[str(i) for i in range(len(LENGTHS))], tags=[{"seq_len": n} for n in LENGTHS],
                        partition_id="train")
    trainer = object.__new__(PPOTrainerSync)
    trainer.config, trainer.actor_rollout_wg = _config(strategy), _Group(ranks)
    trainer.use_critic, trainer.global_steps, trainer.tokenizer = False, 1, SimpleNamespace(eos_token_id=0)
    out = trainer._balance_batch(batch, metrics={})
    assert trainer.actor_rollout_wg._dispatch_info["actor"] == ranks
    return [int(k) for k in out.keys]


@pytest.mark.parametrize("order", [_legacy_order, _v1_order], ids=["legacy", "v1"])
def test_trainer_balances_an_hdp_batch_for_stock_dp_size(order):
    stock = order("megatron", [0, 1])  # stock verl, DP 2
    hdp = order("hdp", [0, 0])  # hdp: every rank is DP rank 0
    one = order("megatron", [0, 0])  # what verl does with the DP size hdp reports, unpatched
    assert hdp == stock
    assert one != stock


def test_trainer_dp_size_follows_tp_and_pp():
    # 8 ranks of TP 2: stock verl's DP is 4, the hdp domain's size
    stock = _legacy_order("megatron", [0, 0, 1, 1, 2, 2, 3, 3])
    assert _legacy_order("hdp", [0] * 8, tp=2) == stock
    from hdp.integrations.verl.minibatches import trainer_dp_size

    assert trainer_dp_size(_config("hdp", tp=2, pp=2), 8) == 2
    assert trainer_dp_size(_config("megatron"), 8) is None
    with pytest.raises(ValueError, match="not a multiple of TP 2 x PP 2"):
        trainer_dp_size(_config("hdp", tp=2, pp=2), 6)


@contextlib.contextmanager
def _one_rank_group():
    import torch.distributed as dist

    with tempfile.TemporaryDirectory() as d:
        dist.init_process_group("gloo", init_method=f"file://{os.path.join(d, 'store')}", rank=0, world_size=1)
        try:
            yield dist.group.WORLD
        finally:
            dist.destroy_process_group()


class _Engine:
    """The engine surface ``TrainingWorker.train_mini_batch`` uses; records each mini-batch's sample ids."""

    def __init__(self, dp_rank: int, dp_size: int, group, domain: int | None = None) -> None:
        self.rank, self.size, self.group, self.seen = dp_rank, dp_size, group, []
        if domain is not None:  # an hdp engine: DP 1 to verl, a domain of `domain` ranks
            self.domain = SimpleNamespace(size=domain)
        self.announced = 0

    def get_data_parallel_size(self):
        return self.size

    def get_data_parallel_rank(self):
        return self.rank

    def get_data_parallel_group(self):
        return self.group

    def is_mp_src_rank_with_outputs(self):
        return False

    def train_mode(self, **kwargs):  # as HdpMegatronEngine.train_mode: its mini-batches inside it
        from hdp.integrations.verl import patches

        return patches.owns_mini_batches(self)

    def announce(self, batches, extend=False):
        self.announced += len(batches)


def _loop(engine, data) -> list[list[int]]:
    from verl.workers.engine_workers import TrainingWorker

    worker = object.__new__(TrainingWorker)
    worker.engine, worker.profiler = engine, SimpleNamespace(step=lambda: None)
    worker.train_batch = lambda td: engine.seen.append(td["sid"].tolist())
    TrainingWorker.train_mini_batch(worker, data)
    return engine.seen


def _batch(rows: range, *, mini: int, epochs: int, shuffle: bool):
    from verl.utils import tensordict_utils as tu

    ids = [torch.arange(LENGTHS[i]) for i in rows]
    return tu.get_tensordict({"input_ids": torch.nested.as_nested_tensor(ids, layout=torch.jagged),
                              "sid": torch.tensor(list(rows))},
                             non_tensor_dict={"mini_batch_size": mini, "epochs": epochs, "seed": 7,
                                              "dataloader_kwargs": {"shuffle": shuffle}})


@pytest.mark.parametrize("shuffle,epochs", [(False, 1), (True, 2)])
def test_worker_loop_trains_stock_minibatches(shuffle, epochs):
    from hdp.integrations.verl import patches

    n, dp, mini = len(LENGTHS), 3, 6  # 12 samples, 3 stock DP ranks, mini-batches of 6: 2 per epoch
    with _one_rank_group() as group:
        ranks = []
        for r in range(dp):  # stock verl: rank r gets its contiguous part and cuts mini / dp per mini-batch
            part = range(r * n // dp, (r + 1) * n // dp)
            ranks.append(_loop(_Engine(r, dp, group), _batch(part, mini=mini, epochs=epochs, shuffle=shuffle)))
        stock = [sorted(sum(shares, [])) for shares in zip(*ranks)]
        plain = _loop(_Engine(0, 1, group), _batch(range(n), mini=mini, epochs=epochs, shuffle=shuffle))
        hdp_engine = _Engine(0, 1, group, domain=dp)
        patches.own_mini_batch_loop(hdp_engine)
        hdp = _loop(hdp_engine, _batch(range(n), mini=mini, epochs=epochs, shuffle=shuffle))
    assert len(stock) == 2 * epochs
    assert [sorted(m) for m in hdp] == stock
    assert [sorted(m) for m in plain] != stock  # verl's loop at DP 1 groups other samples
    assert hdp_engine.announced == len(hdp)  # each mini-batch was announced ahead to this engine


def test_worker_loop_keeps_contiguous_minibatches_where_stock_cannot_split():
    from hdp.integrations.verl import patches

    with _one_rank_group() as group:
        engine = _Engine(0, 1, group, domain=5)  # 5 does not divide 12 (stock verl's worker would assert)
        patches.own_mini_batch_loop(engine)
        got = _loop(engine, _batch(range(12), mini=6, epochs=1, shuffle=False))
    assert got == [list(range(6)), list(range(6, 12))]
