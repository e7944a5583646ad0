"""A CPU rollout for verl's trainer: HF ``transformers`` ``generate`` behind verl's rollout API.

verl 0.9.1 generates through rollout *servers* (vLLM / SGLang / TensorRT-LLM) that need GPUs.  This
module registers a backend ``hf_cpu`` through verl's own registries:

* ``RolloutReplicaRegistry`` (driver side): :class:`HFReplica` launches one :class:`HFServer` Ray
  actor per replica; the server answers verl's token-in/token-out ``generate`` (sampling with
  ``temperature`` / ``top_p`` / ``top_k``, per-token log-probs) on an fp32 HF model;
* the worker-side rollout registry (``verl.workers.rollout.base._ROLLOUT_REGISTRY``, a dict; verl
  has no register call for it): :class:`HFServerAdapter` receives the trainer's weights in
  ``update_weights`` (the hdp engine's ``get_per_tensor_param``, a collective: every rank drains
  it) and rank 0 of the replica loads them into the server.

Select it with ``actor_rollout_ref.rollout.name=hf_cpu`` (laptop demos and tests; slow, one process per
replica).  Never on the engine's runtime path.
"""

from __future__ import annotations

import logging
import re
import zlib
from typing import Any, Generator

import ray

import torch

from verl.workers.rollout.base import BaseRollout
from verl.workers.rollout.replica import RolloutReplica, RolloutReplicaRegistry, TokenOutput

__all__ = ["NAME", "HFServer", "HFReplica", "HFServerAdapter", "register"]

logger = logging.getLogger(__name__)

NAME = "hf_cpu"


def _server_name(replica_rank: int) -> str:
    return f"hdp_hf_server_{replica_rank}"


_EXPERT = re.compile(r"^(.*\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


def _fold_experts(named: dict[str, torch.Tensor], state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``named`` with the per-expert MoE weights of HF's checkpoint layout (what the trainer exports:
    ``experts.{e}.gate_proj.weight`` [F, H], ``up_proj`` [F, H], ``down_proj`` [H, F]) folded into the fused expert
    parameters of a model that holds them (transformers 5's Qwen3-MoE: ``experts.gate_up_proj`` [E, 2F, H], each
    expert's gate rows then its up rows, and ``experts.down_proj`` [E, H, F]), as transformers folds them at load."""
    out: dict[str, torch.Tensor] = {}
    parts: dict[str, dict[tuple[int, str], torch.Tensor]] = {}
    for name, t in named.items():
        m = _EXPERT.match(name)
        if m is not None and f"{m.group(1)}.gate_up_proj" in state:
            parts.setdefault(m.group(1), {})[(int(m.group(2)), m.group(3))] = t
        else:
            out[name] = t
    for prefix, p in parts.items():
        n = state[f"{prefix}.gate_up_proj"].shape[0]
        out[f"{prefix}.gate_up_proj"] = torch.stack([torch.cat([p[(e, "gate_proj")], p[(e, "up_proj")]]) for e in range(n)])
        out[f"{prefix}.down_proj"] = torch.stack([p[(e, "down_proj")] for e in range(n)])  # [E, H, F]
    return out


class HFServer:
    """One rollout server: an HF causal LM on CPU answering verl's ``generate`` requests."""

    def __init__(self, model_path: str, response_length: int, seed: int = 0) -> None:
        from transformers import AutoModelForCausalLM

        torch.set_num_threads(1)
        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
        self.response_length = int(response_length)
        self.eos = self.model.generation_config.eos_token_id
        self.seed = int(seed)
        self.global_steps: int | None = None
        self._seen: dict[tuple[Any, ...], int] = {}  # (step, prompt) -> samples drawn for it so far

    def load_weights(self, named: dict[str, torch.Tensor], global_steps: int | None = None) -> int:
        """Load HF-named weights (the trainer's export); returns how many tensors were set."""
        state = self.model.state_dict()
        named = _fold_experts(named, state)
        missing = set(state) - set(named)
        if missing:
            raise ValueError(f"weight update misses {sorted(missing)[:5]}")
        with torch.no_grad():
            for name, t in named.items():
                state[name].copy_(t.to(state[name].dtype))
        self.global_steps = global_steps
        self._seen = {}  # a new step draws anew
        return len(named)

    @torch.no_grad()
    def generate(self, request_id: str, prompt_ids: list[int], sampling_params: dict[str, Any], **kwargs: Any) -> TokenOutput:
        """Sample a response (ancestral sampling, token by token), with its log-probs when ``sampling_params`` asks."""
        temperature = float(sampling_params.get("temperature", 1.0) or 0.0)
        top_k = int(sampling_params.get("top_k", -1) or -1)
        max_new = int(sampling_params.get("max_tokens", sampling_params.get("max_new_tokens", self.response_length)))
        max_new = min(max_new, self.response_length)
        ids = torch.tensor(prompt_ids, dtype=torch.int64)[None]  # [1, P]
        # each sample's own generator, seeded by (server seed, step, prompt, how many of this prompt came before):
        # requests arrive in any order from verl's async agent loop, and a run repeats its samples
        key = (self.global_steps, tuple(prompt_ids))
        k = self._seen.get(key, 0)
        self._seen[key] = k + 1
        text = repr((self.seed, self.global_steps, tuple(prompt_ids), k)).encode()
        generator = torch.Generator().manual_seed(zlib.crc32(text))
        out, logps = [], []
        past = None
        step_ids = ids
        for _ in range(max_new):
            res = self.model(input_ids=step_ids, past_key_values=past, use_cache=True)
            past = res.past_key_values
            logits = res.logits[0, -1].float()  # [V]
            if temperature <= 0:
                tok = int(torch.argmax(logits))
                lp = torch.log_softmax(logits, -1)[tok]
            else:
                scaled = logits / temperature
                if top_k > 0:
                    kth = torch.topk(scaled, min(top_k, scaled.numel())).values[-1]
                    scaled = scaled.masked_fill(scaled < kth, float("-inf"))
                probs = torch.softmax(scaled, -1)
                tok = int(torch.multinomial(probs, 1, generator=generator))
                lp = torch.log(probs[tok])
            out.append(tok)
            logps.append(float(lp))
            if self.eos is not None and tok in (self.eos if isinstance(self.eos, list) else [self.eos]):
                break
            step_ids = torch.tensor([[tok]], dtype=torch.int64)
        # the log-probs only when asked (verl's agent loop: ``logprobs=rollout.calculate_log_probs``), as vLLM's
        # server answers: verl's driver computes rollout correction whenever the rollout returned them
        return TokenOutput(
            token_ids=out, log_probs=logps if sampling_params.get("logprobs") else None, stop_reason="completed",
            extra_fields={"global_steps": self.global_steps}
        )

    # control methods verl's replica manager calls; nothing to free or resume on CPU
    def wake_up(self) -> None: ...
    def sleep(self) -> None: ...
    def abort_all_requests(self, reject_request: bool = False) -> None: ...
    def resume_generation(self) -> None: ...
    def clear_kv_cache(self) -> None: ...
    def release_kv_cache(self) -> None: ...
    def resume_kv_cache(self) -> None: ...
    def start_profile(self, **kwargs: Any) -> None: ...
    def stop_profile(self) -> None: ...


class HFReplica(RolloutReplica):
    """verl rollout replica (hybrid mode) whose server is one :class:`HFServer` actor."""

    async def launch_servers(self) -> None:
        name = _server_name(self.replica_rank)
        server = (
            ray.remote(HFServer)
            .options(name=name, num_cpus=0, max_concurrency=1)
            .remote(self.model_config.path, self.config.response_length, seed=self.replica_rank)
        )
        self.servers = [server]
        self._server_handle = server
        self._server_address = name

    def rollout_worker_use_gpu(self) -> bool:
        return False


class HFServerAdapter(BaseRollout):
    """Worker-side rollout: forwards the trainer's weights to this replica's :class:`HFServer`."""

    def __init__(self, config: Any, model_config: Any, device_mesh: Any, *args: Any, **kwargs: Any) -> None:
        super().__init__(config, model_config, device_mesh, *args, **kwargs)
        import torch.distributed as dist

        world = self.config.tensor_model_parallel_size * self.config.data_parallel_size * self.config.pipeline_model_parallel_size
        self.replica_rank = dist.get_rank() // world
        self.is_leader = dist.get_rank() % world == 0

    async def resume(self, tags: list[str]) -> None:
        return None

    async def release(self) -> None:
        return None

    async def update_weights(self, weights: Generator[tuple[str, torch.Tensor], None, None], wire_format: str = "named_tensors", **kwargs: Any) -> None:
        if wire_format != "named_tensors":
            raise ValueError(f"wire_format={wire_format!r}: the HF test rollout takes named_tensors only")
        named = {n: t.detach().to("cpu", torch.float32).clone() for n, t in weights}  # every rank drains it
        if self.is_leader:
            server = ray.get_actor(_server_name(self.replica_rank))
            await server.load_weights.remote(named, kwargs.get("global_steps"))


def register() -> None:
    """Register ``hf_cpu`` in verl's replica registry and its worker-side rollout registry (idempotent)."""
    from verl.workers.rollout import base

    RolloutReplicaRegistry.register(NAME, lambda: HFReplica)
    base._ROLLOUT_REGISTRY[(NAME, "async")] = f"{__name__}.HFServerAdapter"


register()
