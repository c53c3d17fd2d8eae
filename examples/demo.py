"""Demo: a small transformer trained five ways on the same batches, then k chosen adaptively.

Run ``python examples/demo.py`` after ``pip install -e ".[demo]"`` (about four
minutes on two CPU cores; ``--help`` lists the sizes). It writes
``results.json``, ``loss_curves.png``, ``memory.png`` and ``adaptive_k.png``
to ``demo_out/`` (``--out``) and prints two tables.

The model is a Flax NNX character-level transformer; the text is the source
of Python's own standard library, one line per sequence, padded to
``--seq-len``. The loss is token-weighted: the sum of per-token
cross-entropy over the real tokens of the whole batch, divided by their
number. Each optimizer step's batch is ``--k`` micro-batches (default 4).

**Part 1: equal to the large batch.** Five arms start from the same
initialisation and see the same batches, sorted by length as
length-bucketing loaders do (so micro-batches hold very different numbers
of real tokens):

* ``full_batch``: plain Adam on the whole batch: the reference;
* ``accumulate``: ``k`` calls of ``accumulate(k, adam, reduction="weighted")``,
  each micro-batch weighted by its real tokens: the same step;
* ``accumulate_bf16``: the same with a bfloat16 buffer: close, not equal;
* ``microbatched``: one call scanning the ``k`` micro-batches
  (``normalize="weighted"``): the same step;
* ``mean_of_means``: ``accumulate(k, adam)`` on each micro-batch's own mean
  loss, the common normalisation bug: a different objective.

**Part 2: how large should k be?** Three arms see the same stream of
micro-batches with the learning rate counted in examples: windows of
``--k-small``, of ``--k-large``, and ``adaptive_k``, whose windows follow the
gradient noise scale.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import optax_accum as oa

PAD, UNK = 0, 1
CHARS = "\n\t" + "".join(chr(c) for c in range(32, 127))
VOCAB_SIZE = 128  # PAD, UNK and the characters above, rounded up
CHAR_IDS = {c: i + 2 for i, c in enumerate(CHARS)}
ARM_LABELS = {
    "full_batch": "full batch",
    "accumulate": "accumulate (weighted)",
    "accumulate_bf16": "accumulate (bf16 buffer)",
    "microbatched": "microbatched (weighted)",
    "mean_of_means": "mean of means (naive)",
}
ARMS = tuple(ARM_LABELS)
ADAPTIVE_ARMS = ("small_k", "large_k", "adaptive_k")
EVAL_POINTS = 6  # eval-loss checkpoints along part 2, the last at the end

Batch = dict[str, np.ndarray]
LossTerms = Callable[[Any, dict[str, jax.Array]], tuple[jax.Array, jax.Array]]


@dataclasses.dataclass(frozen=True)
class Config:
  """The demo's settings, one per command-line flag."""

  steps: int = 300
  k: int = 4
  batch_size: int = 32
  seq_len: int = 64
  d_model: int = 64
  layers: int = 2
  heads: int = 4
  lr: float = 3e-3
  seed: int = 0
  max_files: int = 40
  eval_batches: int = 8
  group_by_length: bool = True
  adaptive: bool = True
  k_small: int = 2
  k_large: int = 16
  fraction: float = 1.0
  min_windows: int = oa.gradient_noise.MIN_WINDOWS
  out: str = "demo_out"
  progress: bool = True


# ---------------------------------------------------------------------------------- data
def load_corpus(max_chars: int, max_files: int) -> list[str]:
  """The lines (2 visible characters or more) of the first ``max_files`` ``.py``
  files, in sorted order, of the standard library's folder: the same on every run."""
  root = os.path.dirname(os.__file__)
  lines: list[str] = []
  for name in sorted(f for f in os.listdir(root) if f.endswith(".py"))[:max_files]:
    with open(os.path.join(root, name), encoding="utf-8", errors="replace") as f:
      lines += [ln.rstrip()[:max_chars] for ln in f.read().splitlines() if len(ln.strip()) >= 2]
  return lines


def encode(text: str, length: int) -> np.ndarray:
  """Character ids of ``text``, cut or padded with ``PAD`` to ``length``."""
  out = np.full(length, PAD, np.int32)
  out[:min(len(text), length)] = [CHAR_IDS.get(c, UNK) for c in text[:length]]
  return out


def make_batches(lines: list[str], cfg: Config, num_batches: int, seed: int) -> Batch:
  """``inputs``/``targets`` (int32) and ``mask`` (float32), each ``[num_batches,
  batch_size, seq_len]``; with ``group_by_length`` each batch sorted by length."""
  rng = np.random.default_rng(seed)
  need = num_batches * cfg.batch_size
  order: list[int] = []
  while len(order) < need:  # epochs repeat, each in a new order
    order.extend(rng.permutation(len(lines)).tolist())
  seqs = np.stack([encode(lines[i], cfg.seq_len + 1) for i in order[:need]])
  seqs = seqs.reshape(num_batches, cfg.batch_size, cfg.seq_len + 1)
  if cfg.group_by_length:
    lengths = (seqs != PAD).sum(-1)
    seqs = np.take_along_axis(seqs, np.argsort(lengths, axis=1, kind="stable")[..., None], 1)
  targets = seqs[..., 1:]
  return {"inputs": seqs[..., :-1].astype(np.int32), "targets": targets.astype(np.int32),
          "mask": (targets != PAD).astype(np.float32)}


def micro_batch(batches: Batch, i: int, j: int, k: int) -> dict[str, jax.Array]:
  """Micro-batch ``j`` of ``k`` (contiguous rows) of batch ``i``, on the device."""
  size = batches["inputs"].shape[1] // k
  return {name: jnp.asarray(v[i, j * size:(j + 1) * size]) for name, v in batches.items()}


# --------------------------------------------------------------------------------- model
class Block(nnx.Module):
  """A pre-LayerNorm transformer block: causal self-attention, then an MLP."""

  def __init__(self, d_model: int, heads: int, rngs: nnx.Rngs) -> None:
    self.ln1 = nnx.LayerNorm(d_model, rngs=rngs)
    self.attn = nnx.MultiHeadAttention(
        num_heads=heads, in_features=d_model, decode=False, keep_rngs=False, rngs=rngs)
    self.ln2 = nnx.LayerNorm(d_model, rngs=rngs)
    self.fc1 = nnx.Linear(d_model, 4 * d_model, rngs=rngs)
    self.fc2 = nnx.Linear(4 * d_model, d_model, rngs=rngs)

  def __call__(self, x: jax.Array, mask: jax.Array) -> jax.Array:
    x = x + self.attn(self.ln1(x), mask=mask)
    return x + self.fc2(nnx.gelu(self.fc1(self.ln2(x))))


class CharTransformer(nnx.Module):
  """A small decoder-only character language model."""

  def __init__(self, *, seq_len: int, d_model: int, layers: int, heads: int,
               rngs: nnx.Rngs) -> None:
    self.embed = nnx.Embed(VOCAB_SIZE, d_model, rngs=rngs)
    self.pos = nnx.Param(0.02 * jax.random.normal(rngs.params(), (seq_len, d_model)))
    self.blocks = nnx.List([Block(d_model, heads, rngs) for _ in range(layers)])
    self.ln_f = nnx.LayerNorm(d_model, rngs=rngs)
    self.head = nnx.Linear(d_model, VOCAB_SIZE, rngs=rngs)

  def __call__(self, tokens: jax.Array) -> jax.Array:
    x = self.embed(tokens) + self.pos[...][: tokens.shape[1]]
    mask = nnx.make_causal_mask(tokens)  # padding sits at the end: no real token sees it
    for block in self.blocks:
      x = block(x, mask)
    return self.head(self.ln_f(x))


def make_loss_terms(graphdef: Any) -> LossTerms:
  """``(params, batch) -> (sum of per-token CE over real tokens, number of real tokens)``."""
  def loss_terms(params: Any, batch: dict[str, jax.Array]) -> tuple[jax.Array, jax.Array]:
    logits = nnx.merge(graphdef, params)(batch["inputs"]).astype(jnp.float32)
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"])
    return jnp.sum(ce * batch["mask"]), jnp.sum(batch["mask"])
  return loss_terms


def own_mean(loss_terms: LossTerms) -> Callable[..., Any]:
  """The batch's own mean over its real tokens, with ``(sum, count)`` as aux."""
  def loss(params: Any, batch: dict[str, jax.Array]) -> tuple[jax.Array, Any]:
    total, count = loss_terms(params, batch)
    return total / jnp.maximum(count, 1.0), (total, count)
  return loss


# ------------------------------------------------------------------------ part 1: the arms
def build_step(arm: str, loss_terms: LossTerms, base: optax.GradientTransformation,
               k: int) -> tuple[optax.GradientTransformation, Callable[..., Any], int]:
  """``(tx, step, calls_per_batch)``: ``step(params, opt_state, batch) -> (params,
  opt_state, loss_sum, tokens)``, called ``calls_per_batch`` times per global batch."""
  grad_fn = jax.value_and_grad(own_mean(loss_terms), has_aux=True)
  if arm == "full_batch":
    def step(params, opt_state, batch):
      (_, (total, count)), grads = grad_fn(params, batch)
      updates, opt_state = base.update(grads, opt_state, params)
      return optax.apply_updates(params, updates), opt_state, total, count
    return base, step, 1

  if arm == "microbatched":
    micro_fn = oa.microbatched(jax.value_and_grad(loss_terms, has_aux=True), k,
                               normalize="weighted")

    def step(params, opt_state, batch):
      loss, grads = micro_fn(params, batch)  # sum_i s_i / sum_i n_i, and its gradient
      updates, opt_state = base.update(grads, opt_state, params)
      count = jnp.sum(batch["mask"])
      return optax.apply_updates(params, updates), opt_state, loss * count, count
    return base, step, 1

  weighted = arm != "mean_of_means"
  tx = oa.accumulate(k, base, reduction="weighted" if weighted else "mean",
                     accumulator_dtype=jnp.bfloat16 if arm == "accumulate_bf16" else None)

  def step(params, opt_state, micro):
    (_, (total, count)), grads = grad_fn(params, micro)
    # weighted: sum_i n_i g_i / sum_i n_i, the full batch's gradient; mean of means:
    # sum_i g_i / k, every micro-batch's own mean weighted alike.
    kw = {"weight": count} if weighted else {}
    updates, opt_state = tx.update(grads, opt_state, params, **kw)
    return optax.apply_updates(params, updates), opt_state, total, count
  return tx, step, k


def compiled_step(step: Callable[..., Any], *args: Any) -> tuple[Any, float]:
  """``step`` compiled for ``args`` and run once on them (a discarded warm-up), with
  the seconds both took."""
  t0 = time.perf_counter()
  compiled = jax.jit(step).lower(*args).compile()
  jax.block_until_ready(compiled(*args))
  return compiled, time.perf_counter() - t0


def eval_loss(evaluate: Callable[..., Any], params: Any, batches: Batch) -> float:
  """Token-weighted loss over held-out batches."""
  sums = [evaluate(params, micro_batch(batches, i, 0, 1))
          for i in range(batches["inputs"].shape[0])]
  return sum(float(s) for s, _ in sums) / max(sum(float(n) for _, n in sums), 1.0)


class _Quiet:
  """What ``--no-progress`` shows: nothing."""

  def update(self, n: int) -> None:
    del n

  def close(self) -> None:
    pass


def progress(cfg: Config, total: int, desc: str) -> Any:
  """A tqdm bar where stderr is a terminal; elsewhere (a log, where a bar is one long line)
  a plain line per stage; nothing with ``--no-progress``."""
  if not cfg.progress:
    return _Quiet()
  if not sys.stderr.isatty():
    print(f"{desc}: {total} ...", file=sys.stderr, flush=True)
    return _Quiet()
  from tqdm.auto import tqdm
  return tqdm(total=total, desc=desc, dynamic_ncols=True)


def run_part1(cfg: Config, loss_terms: LossTerms, params0: Any, batches: Batch,
              eval_batches: Batch) -> dict[str, dict[str, Any]]:
  """The five arms in lockstep (step ``i`` of every arm before step ``i + 1`` of
  any, so a shared machine's load hits them alike); a summary per arm."""
  arms = {}
  for arm in ARMS:
    tx, step, calls = build_step(arm, loss_terms, optax.adam(cfg.lr), cfg.k)
    opt_state = jax.jit(tx.init)(params0)
    compiled, _ = compiled_step(step, params0, opt_state, micro_batch(batches, 0, 0, calls))
    arms[arm] = {"compiled": compiled, "calls": calls, "params": params0,
                 "opt_state": opt_state, "losses": [], "step_s": [], "tokens": 0.0}
  bar = progress(cfg, cfg.steps, f"part 1: {len(ARMS)} arms, steps")
  for i in range(cfg.steps):
    for a in arms.values():
      t0, total, count = time.perf_counter(), 0.0, 0.0
      for j in range(a["calls"]):
        a["params"], a["opt_state"], s, n = a["compiled"](
            a["params"], a["opt_state"], micro_batch(batches, i, j, a["calls"]))
        total, count = total + s, count + n
      total, count = float(total), float(count)  # waits for the step
      a["step_s"].append(time.perf_counter() - t0)
      a["losses"].append(total / max(count, 1.0))
      a["tokens"] += count
    bar.update(1)
  bar.close()
  evaluate = jax.jit(loss_terms)
  full = np.asarray(arms["full_batch"]["losses"])
  return {arm: {
      "label": ARM_LABELS[arm], "calls_per_step": a["calls"], "losses": a["losses"],
      "final_loss": float(np.mean(a["losses"][-10:])),
      "eval_loss": eval_loss(evaluate, a["params"], eval_batches),
      "max_abs_loss_diff_vs_full": float(np.max(np.abs(np.asarray(a["losses"]) - full))),
      # Median step time: robust to the bursts of load on a shared machine.
      "tokens_per_s": a["tokens"] / len(a["step_s"]) / float(np.median(a["step_s"])),
      "real_tokens": a["tokens"],
      "temp_bytes": int(a["compiled"].memory_analysis().temp_size_in_bytes),
  } for arm, a in arms.items()}


# ----------------------------------------------------------------------- part 2: which k
def lr_schedule(cfg: Config, horizon: float) -> optax.Schedule:
  """Warm-up over 5% of ``horizon`` (examples), then cosine decay to 10% of ``cfg.lr``."""
  return optax.warmup_cosine_decay_schedule(
      0.0, cfg.lr, warmup_steps=max(1, round(0.05 * horizon)),
      decay_steps=max(2, round(horizon)), end_value=0.1 * cfg.lr)


def adaptive_arms(cfg: Config, n_micro: int) -> dict[str, tuple[Any, optax.GradientTransformation]]:
  """``{arm: (k, transform)}``: token-weighted, each tracking the noise scale, Adam with
  the learning rate counted in examples (an adaptive run does not know its step count)."""
  policy = oa.adaptive_k(cfg.k_small, cfg.k_large, fraction=cfg.fraction,
                         min_windows=cfg.min_windows)
  horizon = n_micro * (cfg.batch_size // cfg.k)
  return {arm: (k, oa.accumulate(k, optax.chain(
      optax.scale_by_adam(),
      oa.gradient_noise.scale_by_schedule_in_examples(lr_schedule(cfg, horizon))),
      reduction="weighted", track_noise_scale=True))
      for arm, k in (("small_k", cfg.k_small), ("large_k", cfg.k_large), ("adaptive_k", policy))}


def run_part2(cfg: Config, lines: list[str], loss_terms: LossTerms, params0: Any,
              eval_batches: Batch) -> dict[str, Any]:
  """The three arms in lockstep, one micro-batch per call; a summary per arm."""
  b, n_micro = cfg.batch_size // cfg.k, cfg.steps * cfg.k  # as many examples as part 1
  stream = make_batches(lines, dataclasses.replace(cfg, batch_size=b, group_by_length=False),
                        n_micro, cfg.seed + 2)
  grad_fn = jax.value_and_grad(own_mean(loss_terms), has_aux=True)
  evaluate = jax.jit(loss_terms)
  arms = {}
  for arm, (k, tx) in adaptive_arms(cfg, n_micro).items():
    def step(params, opt_state, micro, examples, last, tx=tx):
      (_, (total, count)), grads = grad_fn(params, micro)
      # emit_now on the stream's last micro-batch: a short final window is still a step.
      params, opt_state = oa.update_and_apply(tx, grads, opt_state, params, weight=count,
                                              emit_now=last, examples=examples)
      return (params, opt_state, total, count, opt_state.emitted,
              oa.noise_scale(opt_state, cfg.min_windows))  # NaN until ready

    opt_state = jax.jit(tx.init)(params0)
    compiled, _ = compiled_step(step, params0, opt_state, micro_batch(stream, 0, 0, 1),
                                jnp.float32(b), jnp.bool_(False))
    arms[arm] = {"k": k, "compiled": compiled, "params": params0, "opt_state": opt_state,
                 "out": [], "evals": []}
  checkpoints = {round(n_micro * i / EVAL_POINTS) for i in range(1, EVAL_POINTS + 1)}
  bar = progress(cfg, n_micro, "part 2: 3 arms, micro-batches")
  for j in range(n_micro):
    micro, examples = micro_batch(stream, j, 0, 1), jnp.float32((j + 1) * b)
    for a in arms.values():
      a["params"], a["opt_state"], *out = a["compiled"](
          a["params"], a["opt_state"], micro, examples, jnp.bool_(j == n_micro - 1))
      a["out"].append(out)
      if j + 1 in checkpoints:
        a["evals"].append(((j + 1) * b, eval_loss(evaluate, a["params"], eval_batches)))
    bar.update(1)
  bar.close()
  return {"micro_batch_sequences": b, "micro_batches": n_micro, "total_sequences": n_micro * b,
          "k_small": cfg.k_small, "k_large": cfg.k_large, "fraction": cfg.fraction,
          "arms": {arm: summarise_windows(a, b) for arm, a in arms.items()}}


def summarise_windows(a: dict[str, Any], b: int) -> dict[str, Any]:
  """One part-2 arm: its windows, losses and noise-scale estimates (in sequences)."""
  out = np.asarray([[float(x) for x in o] for o in a["out"]])  # one host sync, at the end
  total, count, emitted, noise = out[:, 0], out[:, 1], out[:, 2] > 0.5, out[:, 3]
  ends = np.flatnonzero(emitted)
  starts = np.concatenate([[0], ends[:-1] + 1])
  tail = slice(int(0.9 * len(out)), len(out))  # the last 10% of the examples
  k = a["k"]
  return {
      "label": (f"adaptive k ({k.k_min}..{k.k_max})"
                if isinstance(k, oa.gradient_noise.AdaptiveK) else f"k = {k}"),
      "optimizer_steps": int(a["opt_state"].gradient_step),
      "mean_k": len(out) / len(ends),
      "window_k": (ends - starts + 1).tolist(),
      "window_end_sequences": ((ends + 1) * b).tolist(),
      "window_loss": [float(total[s:e + 1].sum() / max(count[s:e + 1].sum(), 1.0))
                      for s, e in zip(starts, ends, strict=True)],
      "b_noise_sequences": [float(x * b) if np.isfinite(x) else None for x in noise[ends]],
      "train_loss_last_10pct": float(total[tail].sum() / max(count[tail].sum(), 1.0)),
      "eval_points": [e for e, _ in a["evals"]],
      "eval_losses": [v for _, v in a["evals"]],
      "eval_loss": a["evals"][-1][1],
  }


# ------------------------------------------------------------------------------- reports
def format_table(results: dict[str, Any]) -> str:
  """Part 1's table (Markdown)."""
  rows = ["| arm | jitted calls / step | train loss (mean of last 10 steps) | eval loss |"
          " max abs loss diff vs full | tokens/s | compiled temporaries |",
          "|---|---:|---:|---:|---:|---:|---:|"]
  rows += [f"| {r['label']} | {r['calls_per_step']} | {r['final_loss']:.4f} |"
           f" {r['eval_loss']:.4f} | {r['max_abs_loss_diff_vs_full']:.1e} |"
           f" {r['tokens_per_s']:,.0f} | {r['temp_bytes'] / 2**20:.1f} MiB |"
           for r in results["arms"].values()]
  return "\n".join(rows)


def format_adaptive_table(part2: dict[str, Any]) -> str:
  """Part 2's table (Markdown)."""
  rows = [f"| arm (micro-batches of {part2['micro_batch_sequences']} sequences) |"
          f" optimizer steps | mean k | eval loss at {part2['total_sequences']:,} sequences |"
          " train loss (last 10% of sequences) | final B_noise estimate (sequences) |",
          "|---|---:|---:|---:|---:|---:|"]
  for r in part2["arms"].values():
    bn = r["b_noise_sequences"][-1]
    rows.append(f"| {r['label']} | {r['optimizer_steps']} | {r['mean_k']:.1f} |"
                f" {r['eval_loss']:.4f} | {r['train_loss_last_10pct']:.4f} |"
                f" {'n/a' if bn is None else f'{bn:.0f}'} |")
  return "\n".join(rows)


def plot(results: dict[str, Any], out: Path) -> list[Path]:
  """``loss_curves.png`` and ``memory.png`` (and ``adaptive_k.png`` after part 2)."""
  import matplotlib
  matplotlib.use("Agg", force=True)
  import matplotlib.pyplot as plt

  arms = results["arms"]
  styles = {"full_batch": ("black", "-", 2.5), "accumulate": ("tab:blue", "--", 1.5),
            "accumulate_bf16": ("tab:cyan", "-.", 1.5), "microbatched": ("tab:green", ":", 1.5),
            "mean_of_means": ("tab:red", "-", 1.2)}
  cfg = results["config"]
  title = (f"{cfg['steps']} steps, batch {cfg['batch_size']} = {cfg['k']} x"
           f" {cfg['batch_size'] // cfg['k']} sequences, {results['num_params']:,} params")
  full = np.asarray(arms["full_batch"]["losses"])
  fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
  for arm, r in arms.items():
    color, ls, lw = styles[arm]
    steps = np.arange(1, len(r["losses"]) + 1)
    ax1.plot(steps, r["losses"], color=color, ls=ls, lw=lw, label=r["label"])
    if arm != "full_batch":
      ax2.semilogy(steps, np.maximum(np.abs(np.asarray(r["losses"]) - full), 1e-9),
                   color=color, ls=ls, label=r["label"])
  ax1.set(xlabel="optimizer step", ylabel="training loss (CE per real token)",
          title="Loss curves")
  ax2.set(xlabel="optimizer step", ylabel="|loss - full-batch loss| (floored at 1e-9)",
          title="Deviation from the full batch")
  paths = [out / "loss_curves.png", out / "memory.png"]
  _save(plt, fig, (ax1, ax2), title, paths[0])

  fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
  labels = [r["label"].replace(" (", "\n(") for r in arms.values()]
  colors = [styles[arm][0] for arm in arms]
  for ax, values, fmt, name in (
      (ax1, [r["temp_bytes"] / 2**20 for r in arms.values()], "{:.1f} MiB",
       "compiled temporaries of one jitted call (MiB)"),
      (ax2, [r["tokens_per_s"] for r in arms.values()], "{:,.0f}",
       "real tokens / s (this machine)")):
    ax.bar_label(ax.bar(labels, values, color=colors), labels=[fmt.format(v) for v in values])
    ax.set_title(name)
    ax.tick_params(axis="x", labelsize=8)
    ax.margins(y=0.15)
  _save(plt, fig, (), title, paths[1])
  if "adaptive" in results:
    paths.append(plot_part2(plt, results["adaptive"], out / "adaptive_k.png"))
  return paths


def plot_part2(plt: Any, part2: dict[str, Any], path: Path) -> Path:
  """Loss against sequences seen; the noise-scale estimates and the adaptive window."""
  b = part2["micro_batch_sequences"]
  colors = {"small_k": "tab:orange", "large_k": "tab:purple", "adaptive_k": "tab:blue"}
  fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
  for arm, r in part2["arms"].items():
    x = np.asarray(r["window_end_sequences"], float)
    k = np.asarray(r["window_k"], float)
    bins = np.minimum((x / x.max() * 40).astype(int), 39)  # 40 bins of sequences seen
    weight = np.bincount(bins, k, 40)
    seen = weight > 0
    ax1.plot((np.arange(40)[seen] + 0.5) * x.max() / 40,
             np.bincount(bins, k * np.asarray(r["window_loss"]), 40)[seen] / weight[seen],
             color=colors[arm], label=f"{r['label']}: {r['optimizer_steps']} steps,"
             f" mean k {r['mean_k']:.1f}")
    ax1.plot(r["eval_points"], r["eval_losses"], "o--", color=colors[arm], ms=4, lw=0.8)
    ax2.plot(x, [np.nan if v is None else v for v in r["b_noise_sequences"]],
             color=colors[arm], lw=1.0, label=f"B_noise estimate, {r['label']}")
    if arm == "adaptive_k":  # (not the last window: the end of the data cuts it short)
      ax2.step(x[:-1], k[:-1] * b, where="pre", color="black", lw=1.5,
               label=f"adaptive window: k x {b} sequences")
  for k in (part2["k_small"], part2["k_large"]):
    ax2.axhline(k * b, color="gray", ls=":", lw=1)
  ax1.set(xlabel="sequences seen", ylabel="loss (CE per real token)",
          title="Training loss (binned) and eval loss (o) at equal examples")
  ax2.set(xlabel="sequences seen", ylabel="sequences", yscale="log",
          title=f"Noise scale B_noise and the adaptive window (fraction {part2['fraction']:g})")
  _save(plt, fig, (ax1, ax2), f"The same {part2['total_sequences']:,} sequences in"
        f" micro-batches of {b}; learning rate counted in examples", path)
  return path


def _save(plt: Any, fig: Any, legends: Sequence[Any], title: str, path: Path) -> None:
  for ax in legends:
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3, which="both")
  fig.suptitle(title)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


# ---------------------------------------------------------------------------------- main
def parse_args(argv: Sequence[str] | None) -> Config:
  """The command line, as a :class:`Config`."""
  d = Config()
  p = argparse.ArgumentParser(prog="python examples/demo.py", description=__doc__.split("\n")[0])

  def flag(name: str, text: str, **kw: Any) -> None:
    p.add_argument(f"--{name}", default=getattr(d, name.replace("-", "_")), help=text, **kw)

  flag("steps", "optimizer steps per arm", type=int)
  flag("k", "micro-batches per optimizer step", type=int)
  flag("batch-size", "sequences per optimizer step (the large batch), divisible by k", type=int)
  flag("seq-len", "tokens per sequence", type=int)
  flag("d-model", "model width", type=int)
  flag("layers", "transformer blocks", type=int)
  flag("heads", "attention heads", type=int)
  flag("lr", "Adam's learning rate", type=float)
  flag("seed", "init and data-order seed", type=int)
  flag("max-files", "standard-library .py files to read, in sorted order", type=int)
  flag("eval-batches", "held-out batches for the eval loss", type=int)
  flag("group-by-length", "sort each batch by length before cutting it (part 1)",
       action=argparse.BooleanOptionalAction)
  flag("adaptive", "run part 2 (which k)", action=argparse.BooleanOptionalAction)
  flag("k-small", "part 2: the small fixed k, and adaptive k's minimum", type=int)
  flag("k-large", "part 2: the large fixed k, and adaptive k's maximum", type=int)
  flag("fraction", "part 2: adaptive k aims at this fraction of the noise scale", type=float)
  flag("min-windows", "part 2: windows in the estimate before it drives k", type=int)
  flag("out", "output folder")
  p.add_argument("--no-progress", dest="progress", action="store_false",
                 help="no progress bars (nor, with stderr redirected, a line per stage)")
  a = p.parse_args(argv)
  if a.k < 1 or a.batch_size % a.k:
    p.error(f"--batch-size ({a.batch_size}) must be divisible by --k ({a.k}).")
  if a.d_model % a.heads:
    p.error(f"--d-model ({a.d_model}) must be divisible by --heads ({a.heads}).")
  return Config(**{f.name: getattr(a, f.name) for f in dataclasses.fields(Config)})


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
  """Runs both parts, writes ``results.json`` and the plots, prints the tables."""
  cfg = parse_args(argv)
  start, out = time.perf_counter(), Path(cfg.out)
  out.mkdir(parents=True, exist_ok=True)
  lines = load_corpus(cfg.seq_len + 1, cfg.max_files)
  held_out = max(1, len(lines) // 10)
  batches = make_batches(lines[:-held_out], cfg, cfg.steps, cfg.seed)
  eval_batches = make_batches(lines[-held_out:], cfg, cfg.eval_batches, cfg.seed + 1)
  graphdef, params0 = nnx.split(CharTransformer(
      seq_len=cfg.seq_len, d_model=cfg.d_model, layers=cfg.layers, heads=cfg.heads,
      rngs=nnx.Rngs(cfg.seed)))
  loss_terms = make_loss_terms(graphdef)
  tokens = batches["mask"].reshape(cfg.steps, cfg.k, -1).sum(-1)
  n_params = sum(x.size for x in jax.tree.leaves(params0))
  print(f"{len(lines):,} lines of Python (the first {cfg.max_files} .py files of the standard"
        f" library), {n_params:,} params, {cfg.steps} steps of {cfg.batch_size}"
        f" sequences = {cfg.k} micro-batches of {cfg.batch_size // cfg.k}, real tokens per"
        f" micro-batch {tokens.min():.0f}..{tokens.max():.0f}", flush=True)
  arms = run_part1(cfg, loss_terms, params0, batches, eval_batches)
  diff = {arm: r["max_abs_loss_diff_vs_full"] for arm, r in arms.items()}
  results: dict[str, Any] = {
      "config": dataclasses.asdict(cfg), "num_params": int(n_params),
      "padding_fraction": float(1 - batches["mask"].mean()),
      "micro_batch_real_tokens": {"min": float(tokens.min()), "max": float(tokens.max())},
      "arms": arms, "exact_arms_max_abs_loss_diff": max(diff["accumulate"], diff["microbatched"]),
      "bf16_buffer_max_abs_loss_diff": diff["accumulate_bf16"],
      "jax": {"version": jax.__version__, "backend": jax.default_backend()}}
  print("\n" + format_table(results) + "\n")
  print(f"accumulate and microbatched against the full batch: max |loss diff|"
        f" {results['exact_arms_max_abs_loss_diff']:.1e} (float rounding: the same step);"
        f" mean of means {diff['mean_of_means']:.1e} (a different objective); bf16 buffer"
        f" {diff['accumulate_bf16']:.1e} (each add rounded)")
  if cfg.adaptive:
    results["adaptive"] = run_part2(cfg, lines[:-held_out], loss_terms, params0, eval_batches)
    print("\n" + format_adaptive_table(results["adaptive"]) + "\n")
  paths = plot(results, out)
  results["wall_s"] = time.perf_counter() - start
  (out / "results.json").write_text(json.dumps(results, indent=1))
  print(f"wrote {out / 'results.json'}, {', '.join(map(str, paths))}"
        f" in {results['wall_s']:.0f} s")
  return results


if __name__ == "__main__":
  main()
