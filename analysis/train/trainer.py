"""The training loop: AdamW, warm-up + cosine/constant schedule, clipping, bf16 autocast on CUDA,
optional torch.compile, DistributedDataParallel under ``torchrun``, a JSONL log with the sink metric,
and atomic, resumable checkpoints (see ``analysis.model.reference.checkpoint``).

Typical use::

    from analysis.train import ModelConfig, TrainConfig, train
    result = train(ModelConfig(attention="sigmoid"), TrainConfig(out="runs/sig", steps=4000))
    result.model, result.final["sink_1"]
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
import os
import shlex
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F

from analysis.core.io import write_atomic
from analysis.sinks.metric import sink_metric
from analysis.model.reference.checkpoint import (
    CheckpointError,
    latest_checkpoint,
    load_checkpoint,
    save_checkpoint,
    save_reference,
)
from analysis.model.reference.config import ModelConfig, TrainConfig, snapshot_steps
from analysis.model.reference.data import build_data, load_tokenizer_file
from analysis.dynamics.metrics import first_token_stats, sink_rate, slot_sink_rate, window_sink_rates
from analysis.model.reference.sink_lm import SinkLM
from analysis.model.access import attention_window, reference_config
from analysis.train.presets import config_to_args

# Train options that decide which batches a run sees: a resumed run must keep them.
_DATA_KEYS = tuple(
    "seed batch_size dataset dataset_split text_column corpus_max_chars tokenizer tokenizer_vocab_size bos "
    "fixed_token_position fixed_token_id prefix_len synthetic_vocab synthetic_triggers synthetic_seed "
    "synthetic_bos synthetic_keys synthetic_lags synthetic_topics synthetic_noise val_fraction".split()
)


@dataclass
class TrainResult:
    """What a training run leaves.

    Attributes
    ----------
    model : SinkLM
        The trained model.
    out : pathlib.Path or None
        The run's folder (None: nothing written).
    log : list of dict
        One record per evaluation (step, losses, sink rates, ...).
    final : dict
        The last record (``final["sink_1"]``: Sink_1 at the end).
    """

    model: SinkLM
    out: Optional[Path]
    log: list = field(default_factory=list)
    final: dict = field(default_factory=dict)


# ----------------------------------------------------------------------------- pieces


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Learning rate for optimiser step ``step`` (0-based): linear warm-up, then constant or cosine.

    Parameters
    ----------
    step : int
    cfg : TrainConfig

    Returns
    -------
    float
    """
    if cfg.warmup_steps and step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    if cfg.schedule == "constant":
        return cfg.lr
    progress = (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps)
    floor = cfg.lr * cfg.min_lr_ratio
    return floor + (cfg.lr - floor) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))


def param_groups(model: torch.nn.Module, cfg: TrainConfig) -> tuple[list[dict], list[str]]:
    """AdamW groups: weight decay on every parameter, or (``decay_all_params=False``) on tensors with
    two or more dimensions only. Returns (groups, parameter names in optimiser order).

    Parameters
    ----------
    model : torch.nn.Module
    cfg : TrainConfig

    Returns
    -------
    groups : list of dict
    names : list of str
    """
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if cfg.decay_all_params:
        decay, no_decay = named, []
    else:
        decay = [(n, p) for n, p in named if p.ndim >= 2]
        no_decay = [(n, p) for n, p in named if p.ndim < 2]
    groups = [{"params": [p for _, p in decay], "weight_decay": cfg.weight_decay}]
    if no_decay:
        groups.append({"params": [p for _, p in no_decay], "weight_decay": 0.0})
    return groups, [n for n, _ in decay] + [n for n, _ in no_decay]


def resolve_device(pref: str, *, local_rank: int = 0) -> torch.device:
    """The device a run trains on.

    Parameters
    ----------
    pref : str
        "auto", "cpu", "cuda" or "cuda:N".
    local_rank : int
        The process's GPU under torchrun.

    Returns
    -------
    torch.device
    """
    if pref == "auto":
        return torch.device(f"cuda:{local_rank}" if torch.cuda.is_available() else "cpu")
    if pref == "cuda" and torch.cuda.is_available():
        return torch.device(f"cuda:{local_rank}")
    if pref.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device={pref!r} but CUDA is not available; use --device cpu or auto.")
    return torch.device(pref)


def _init_distributed(device_pref: str) -> tuple[int, int, int]:
    """(rank, world size, local rank); initialises the process group under torchrun."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size(), int(os.environ.get("LOCAL_RANK", dist.get_rank()))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return 0, 1, 0
    local = int(os.environ.get("LOCAL_RANK", "0"))
    use_nccl = torch.cuda.is_available() and device_pref != "cpu"
    if use_nccl:
        torch.cuda.set_device(local)
    dist.init_process_group("nccl" if use_nccl else "gloo")
    return dist.get_rank(), dist.get_world_size(), local


def _default_command(mcfg: ModelConfig, tcfg: TrainConfig) -> str:
    """An equivalent ``python -m analysis train`` command (fields that differ from the defaults)."""
    return shlex.join(["python", "-m", "analysis", "train", *config_to_args(mcfg, tcfg)])


def _truncate_log(path: Path, step: int) -> list[dict]:
    """Keep the log records up to ``step`` (a killed run may have logged past its last checkpoint)."""
    if not path.is_file():
        return []
    kept = []
    for line in path.read_text().splitlines():
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line cut by the kill
        if rec.get("step", 0) <= step:
            kept.append(rec)
    write_atomic(path, "".join(json.dumps(r) + "\n" for r in kept))
    return kept


def _config_diff(saved: dict, current: dict, keys=None) -> list[str]:
    keys = keys or sorted(set(saved) | set(current))
    return [
        f"{k}: checkpoint {saved.get(k)!r} vs now {current.get(k)!r}" for k in keys if saved.get(k) != current.get(k)
    ]


def _mean_loss(model: SinkLM, tokens: torch.Tensor, batch_size: int = 64) -> float:
    dev = model.device
    losses = [
        float(model(tokens[i : i + batch_size].to(dev), return_type="loss")) for i in range(0, len(tokens), batch_size)
    ]
    return sum(losses) / len(losses)


@torch.no_grad()
def evaluate(
    model: SinkLM, probe: torch.Tensor, eps: float, *, probe_no_fixed: Optional[torch.Tensor] = None, k_max: int = 4
) -> dict:
    """Held-out probe statistics, logged at every evaluation:

    ``sink_1``, ``sink_k`` (Sink_k for k = 1..k_max, percent), first-token ratios (``resid_norm_ratio`` of the
    last layer, ``value_norm_ratio`` and ``raw_first_mass`` averaged over layers, ``spike_ratio``: the
    largest first-token spike ratio over layers), ``sink_slot`` (sink token / K / KV bias slot),
    ``sink_prefix`` (prefix LM: Sink on the best prefix position 2..p), ``sink_1_in_window`` and
    ``sink_window_start`` (sliding window: ``metrics.window_sink_rates``), ``val_loss``; with
    ``probe_no_fixed`` (the probe without its fixed first token) ``sink_1_no_fixed`` and
    ``val_loss_no_fixed``.

    Parameters
    ----------
    model : SinkLM
    probe : torch.Tensor, shape (N, T)
        The held-out probe.
    eps : float
        The sink threshold.
    probe_no_fixed : torch.Tensor, shape (N, T), optional
        The probe without the fixed token.
    k_max : int

    Returns
    -------
    dict
    """
    was = model.training
    model.eval()
    try:
        p = reference_config(model).prefix_attention
        res = sink_metric(model, probe, eps=eps, k_max=max(k_max, min(p, probe.shape[1])))
        out = {
            "sink_1": round(res.sink_rate(1), 4),
            "sink_k": [round(res.sink_rate(k), 4) for k in range(1, min(k_max, res.k_max) + 1)],
        }
        if p > 1:
            best = res.alpha[..., 1:p].amax(-1)  # (N, L, H): the best prefix position after the first
            out["sink_prefix"] = round(100.0 * float((best > eps).float().mean()), 4)
        stats = first_token_stats(model, probe)
        out["resid_norm_ratio"] = round(float(stats.resid_norm_ratio[-1]), 5)
        out["value_norm_ratio"] = round(float(stats.value_norm_ratio.mean()), 5)
        out["raw_first_mass"] = round(float(stats.raw_first_mass.mean()), 5)
        out["spike_ratio"] = round(float(stats.spike_ratio.max()), 3)
        if "blocks.0.attn.hook_sink_pattern" in model.hook_dict:
            out["sink_slot"] = round(slot_sink_rate(model, probe, eps=eps), 4)
        if attention_window(model) is not None:
            out.update({k: round(v, 4) for k, v in window_sink_rates(model, probe, eps=eps).items()})
        out["val_loss"] = round(_mean_loss(model, probe), 5)
        if probe_no_fixed is not None:
            out["sink_1_no_fixed"] = round(sink_rate(model, probe_no_fixed, k=1, eps=eps), 4)
            out["val_loss_no_fixed"] = round(_mean_loss(model, probe_no_fixed), 5)
    finally:
        model.train(was)
    return out


# ----------------------------------------------------------------------------- the loop


def _batch_split(tcfg: TrainConfig, world: int) -> tuple[int, int]:
    """(sequences per process, sequences per micro-batch), checked."""
    if tcfg.batch_size % world:
        raise ValueError(f"batch_size={tcfg.batch_size} must be divisible by the number of processes ({world}).")
    per_rank = tcfg.batch_size // world
    micro = tcfg.micro_batch_size or per_rank
    if per_rank % micro:
        raise ValueError(f"the per-process batch ({per_rank}) must be a multiple of micro_batch_size={micro}.")
    return per_rank, micro


def _data_and_probes(tcfg: TrainConfig, mcfg: ModelConfig, out: Optional[Path], resuming: bool):
    """The data (a resumed natural-text run reuses its own tokenizer), the model config fitted to it, the probes."""
    tokenizer = None
    if resuming and out is not None and (out / "tokenizer.json").is_file():
        tokenizer = load_tokenizer_file(out / "tokenizer.json")
    data = build_data(tcfg, mcfg.n_ctx, tokenizer=tokenizer)
    if mcfg.d_vocab != data.vocab_size:
        mcfg = ModelConfig.from_dict({**mcfg.to_dict(), "d_vocab": data.vocab_size})
    if tcfg.probe_len > mcfg.n_ctx:
        tcfg.probe_len = mcfg.n_ctx
    probes = (
        data.probe(tcfg.probe_size, tcfg.probe_len),
        data.probe_without_fixed_token(tcfg.probe_size, tcfg.probe_len),
    )
    if tcfg.prefix_len and not mcfg.prefix_attention:  # prefix LM: the prefix attends bidirectionally
        mcfg = ModelConfig.from_dict({**mcfg.to_dict(), "prefix_attention": tcfg.prefix_len})
    return data, mcfg, probes


def _resume(ckpt: Optional[Path], out, model, optimizer, names, mcfg, tcfg, main: bool) -> tuple[int, list]:
    """(first step, the log so far): restore ``ckpt`` after checking it was written with the same options."""
    if ckpt is None:
        return 0, []
    state = json.loads((ckpt / "state.json").read_text())
    diff = _config_diff(state.get("model_config", {}), mcfg.to_dict())
    diff += _config_diff(state.get("train_config", {}), tcfg.to_dict(), _DATA_KEYS)
    if diff:
        raise CheckpointError(
            f"cannot resume {out}: the checkpoint was written with other options ({'; '.join(diff[:4])}). "
            "Resume with the same options (only --steps and logging options may change), or use a new --out."
        )
    start = int(load_checkpoint(ckpt, model, optimizer, names)["step"])
    return start, (_truncate_log(out / "train_log.jsonl", start) if main and out is not None else [])


def _prepare_out(out: Path, start: int, command, mcfg, tcfg, data) -> None:
    out.mkdir(parents=True, exist_ok=True)
    if start == 0:
        write_atomic(out / "command.txt", (command or _default_command(mcfg, tcfg)) + "\n")
        write_atomic(out / "train_log.jsonl", "")
    if data.tokenizer is not None and hasattr(data.tokenizer, "backend_tokenizer"):
        data.tokenizer.backend_tokenizer.save(str(out / "tokenizer.json"))


def _runner(model, device: torch.device, world: int, tcfg: TrainConfig):
    """(the module the steps call: DDP and/or compiled around ``model``, the autocast context factory, the attention
    kernel the run takes: read before the first step from the kernel table; a fallback is logged once by the table and
    recorded in the run's config.json, ``attention_kernel``)."""
    runner = model
    if world > 1:
        from torch.nn.parallel import DistributedDataParallel as DDP

        runner = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    if tcfg.compile:
        runner = torch.compile(runner)
    use_bf16 = tcfg.precision == "bf16" or (tcfg.precision == "auto" and device.type == "cuda")
    autocast = (lambda: torch.autocast(device.type, dtype=torch.bfloat16)) if use_bf16 else contextlib.nullcontext
    return runner, autocast, model.attention_kernel(device.type, torch.bfloat16 if use_bf16 else torch.float32)


@dataclass
class _Loop:
    """One run's training state between steps: ``step(step)`` trains on one batch, ``record(...)`` logs it."""

    model: SinkLM
    runner: torch.nn.Module
    optimizer: torch.optim.Optimizer
    data: object
    tcfg: TrainConfig
    device: torch.device
    autocast: object
    rank: int
    world: int
    per_rank: int
    micro: int

    def step(self, step: int) -> tuple[float, torch.Tensor, torch.Tensor]:
        """One optimiser step on batch ``step``: (lr, summed loss over processes, gradient norm)."""
        lr = lr_at(step, self.tcfg)
        for g in self.optimizer.param_groups:
            g["lr"] = lr
        batch = self.data.batch(step, self.tcfg.batch_size)
        n_valid = int((batch.targets != -100).sum())
        mine = slice(self.rank * self.per_rank, (self.rank + 1) * self.per_rank)
        x_all, y_all = batch.inputs[mine].to(self.device), batch.targets[mine].to(self.device)
        loss_acc = torch.zeros((), device=self.device)
        n_micro, micro, world = self.per_rank // self.micro, self.micro, self.world
        for i in range(n_micro):
            x, y = x_all[i * micro : (i + 1) * micro], y_all[i * micro : (i + 1) * micro]
            sync = contextlib.nullcontext() if (world == 1 or i == n_micro - 1) else self.runner.no_sync()
            with sync:
                with self.autocast():
                    logits = self.runner(x)
                # sum over this micro-batch / tokens of the global batch, x world (DDP averages grads)
                loss = F.cross_entropy(
                    logits.float().flatten(0, 1), y.flatten(), ignore_index=-100, reduction="sum"
                ) * (world / n_valid)
                loss.backward()
            loss_acc += loss.detach()
        grad_norm = self._clip()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        if world > 1:
            dist.all_reduce(loss_acc)
        return lr, loss_acc, grad_norm

    def _clip(self) -> torch.Tensor:
        params = self.model.parameters()
        if self.tcfg.grad_clip > 0:
            return torch.nn.utils.clip_grad_norm_(params, self.tcfg.grad_clip)
        return torch.norm(torch.stack([p.grad.norm() for p in params if p.grad is not None]))


def _should_log(done: int, tcfg: TrainConfig) -> bool:
    return done % tcfg.log_every == 0 or done == tcfg.steps or _should_eval(done, tcfg)


def _should_eval(done: int, tcfg: TrainConfig) -> bool:
    return bool(tcfg.eval_every and done % tcfg.eval_every == 0) or done == tcfg.steps or done in _snapshot_set(tcfg)


def _snapshot_set(tcfg: TrainConfig) -> frozenset:
    """The steps whose weights are kept (``TrainConfig.snapshots``)."""
    return _snapshot_steps(tcfg.snapshots, tcfg.steps)


@functools.lru_cache(maxsize=8)
def _snapshot_steps(spec, steps: int) -> frozenset:
    return frozenset(snapshot_steps(spec, steps))


def _describe(mcfg: ModelConfig, tcfg: TrainConfig, data) -> str:
    return (
        f"{mcfg.attention} attention, {mcfg.n_layers} layer(s) x {mcfg.n_heads} heads, d_model "
        f"{mcfg.d_model}, {mcfg.positional_embedding_type} positions; {tcfg.steps} steps of "
        f"{tcfg.batch_size} x {mcfg.n_ctx} tokens on {data.description}"
    )


def _checkpoint(loop: _Loop, out: Optional[Path], done: int, main: bool, names, mcfg: ModelConfig) -> None:
    tcfg = loop.tcfg
    if out is not None and tcfg.checkpoint_every and (done % tcfg.checkpoint_every == 0 or done == tcfg.steps):
        if main:
            save_checkpoint(
                out,
                done,
                loop.model,
                loop.optimizer,
                names,
                {"model_config": mcfg.to_dict(), "train_config": tcfg.to_dict()},
                tcfg.keep_checkpoints,
            )
        if loop.world > 1:
            dist.barrier()


def _snapshot(loop: _Loop, out: Optional[Path], done: int, main: bool, mcfg: ModelConfig, data, record: dict) -> None:
    """Keep the weights at the snapshot steps (``--snapshots``) as ``out/snapshots/step-NNNNNNN``, a reference folder
    that ``load_reference`` loads (its ``final`` holds the evaluation at that step, when one ran)."""
    if out is None or not main or done not in _snapshot_set(loop.tcfg):
        return
    save_reference(
        out / "snapshots" / f"step-{done:07d}",
        loop.model,
        {
            "description": _describe(mcfg, loop.tcfg, data) + f" (snapshot at step {done})",
            "step": done,
            "model": mcfg.to_dict(),
            "train": loop.tcfg.to_dict(),
            "data": data.meta(),
            "final": record,
        },
    )


def _run_steps(
    loop: _Loop,
    start: int,
    out: Optional[Path],
    main: bool,
    log: list,
    mcfg: ModelConfig,
    names,
    probes,
    stop_after: Optional[int],
) -> tuple[dict, bool]:
    """Steps ``start`` .. ``tcfg.steps``: train, log (``log`` and train_log.jsonl), evaluate, checkpoint.
    Returns (the last record this run logged, whether ``stop_after`` ended it early)."""
    from tqdm.auto import tqdm

    tcfg = loop.tcfg
    bar = tqdm(total=tcfg.steps, initial=start, disable=not (tcfg.progress and main), desc="train", dynamic_ncols=True)
    log_file = open(out / "train_log.jsonl", "a") if (main and out is not None) else None
    tokens_per_step = tcfg.batch_size * mcfg.n_ctx
    t_last, steps_since, t0 = time.perf_counter(), 0, time.perf_counter()
    last = {}
    loop.model.train()
    try:
        for step in range(start, tcfg.steps):
            lr, loss_acc, grad_norm = loop.step(step)
            done = step + 1
            steps_since += 1
            rec = {}
            if _should_log(done, tcfg):
                now = time.perf_counter()
                rec = {
                    "step": done,
                    "loss": round(float(loss_acc) / loop.world, 5),
                    "lr": lr,
                    "grad_norm": round(float(grad_norm), 5),
                    "tokens_per_s": round(steps_since * tokens_per_step / max(now - t_last, 1e-9), 1),
                    "tokens": done * tokens_per_step,
                    "elapsed_s": round(now - t0, 2),
                }
                if main:
                    if _should_eval(done, tcfg):
                        rec.update(evaluate(loop.model, probes[0], tcfg.sink_eps, probe_no_fixed=probes[1]))
                    log.append(rec)
                    last = rec
                    if log_file is not None:
                        log_file.write(json.dumps(rec) + "\n")
                        log_file.flush()
                    bar.set_postfix({k: rec[k] for k in ("loss", "sink_1") if k in rec})
                t_last, steps_since = time.perf_counter(), 0
            bar.update(1)
            _snapshot(loop, out, done, main, mcfg, loop.data, rec)
            _checkpoint(loop, out, done, main, names, mcfg)
            if stop_after is not None and done >= stop_after:
                return last, True
    finally:
        bar.close()
        if log_file is not None:
            log_file.close()
    return last, False


def train(
    model_cfg: ModelConfig, train_cfg: TrainConfig, *, command: Optional[str] = None, _stop_after: Optional[int] = None
) -> TrainResult:
    """Pre-train a model from scratch (or resume); returns the trained model in eval mode.

    ``command``: recorded in ``command.txt`` (default: an equivalent CLI command).
    ``_stop_after``: stop after this many steps without writing the final model (tests: an interruption).

    Parameters
    ----------
    model_cfg : ModelConfig
    train_cfg : TrainConfig
    command : str, optional

    Returns
    -------
    TrainResult
    """
    mcfg, tcfg = ModelConfig.from_dict(model_cfg.to_dict()), TrainConfig.from_dict(train_cfg.to_dict())
    rank, world, local_rank = _init_distributed(tcfg.device)
    device = resolve_device(tcfg.device, local_rank=local_rank)
    out = Path(tcfg.out).expanduser() if tcfg.out else None
    main = rank == 0
    per_rank, micro = _batch_split(tcfg, world)
    ckpt = latest_checkpoint(out) if out is not None else None
    if out is not None and not tcfg.resume and (ckpt is not None or (out / "model.safetensors").exists()):
        raise ValueError(f"{out} already holds a run; pass --resume to continue it, or choose a new --out.")
    data, mcfg, probes = _data_and_probes(tcfg, mcfg, out, ckpt is not None)

    torch.manual_seed(tcfg.seed)
    model = SinkLM(mcfg, tokenizer=data.tokenizer).to(device)
    groups, names = param_groups(model, tcfg)
    optimizer = torch.optim.AdamW(
        groups, lr=tcfg.lr, betas=(tcfg.beta1, tcfg.beta2), fused=(device.type == "cuda") or None
    )
    start, log = _resume(ckpt, out, model, optimizer, names, mcfg, tcfg, main)
    if main and out is not None:
        _prepare_out(out, start, command, mcfg, tcfg, data)
    runner, autocast, kernel = _runner(model, device, world, tcfg)
    loop = _Loop(model, runner, optimizer, data, tcfg, device, autocast, rank, world, per_rank, micro)
    last, stopped = _run_steps(loop, start, out, main, log, mcfg, names, probes, _stop_after)
    if stopped:
        return TrainResult(model.eval(), out, log, last)
    final = dict(last or (log[-1] if log else {}))
    if main and out is not None:
        save_reference(
            out,
            model,
            {
                "description": _describe(mcfg, tcfg, data),
                "model": mcfg.to_dict(),
                "train": tcfg.to_dict(),
                "data": data.meta(),
                "attention_kernel": kernel,
                "final": final,
            },
        )
    if world > 1:
        dist.barrier()
    return TrainResult(model.eval(), out, log, final)
