"""Demo: train a small character-level transformer five ways, then choose ``k`` adaptively.

Run ``python -m optax_accum.demo`` (after ``pip install "optax_accum[demo]"``;
about three minutes on two CPU cores; ``--help`` lists the sizes). The
model is a Flax NNX decoder-only transformer; the text is the source code of
Python's own standard library, cut into lines of varying length and padded to
``--seq-len``. The loss is token-weighted: the sum of per-token cross-entropy
over the real (non-padding) tokens of the whole batch, divided by their
number.

Five arms start from the same initialisation and see the same batches in the
same order:

* ``full_batch``: one jitted step on the whole batch of ``--batch-size``.
* ``accumulate``: ``k`` jitted calls on micro-batches of ``batch_size / k``
  with ``accumulate(k, adam, reduction="weighted")``, each micro-batch weighted
  by its number of real tokens: exactly the full batch's step.
* ``accumulate_bf16``: the same with ``accumulator_dtype=jnp.bfloat16``, half
  the buffer, each add rounded stochastically: close to the full batch, not
  equal.
* ``microbatched``: one jitted step that scans over the ``k`` micro-batches
  (``microbatched(..., normalize="weighted")``): also exactly the full batch.
* ``mean_of_means``: ``accumulate(k, adam)`` on per-micro-batch *mean*
  losses, the common normalisation bug: a micro-batch of short lines weighs as
  much as one of long lines, so it trains on a different objective.

How many micro-batches: unless ``--k`` is given, ``k`` is the smallest number
of micro-batches whose compiled ``microbatched`` step fits ``--memory-limit``
MiB per device, chosen by :func:`optax_accum.plan_k` before anything runs
(the default budget of 16 MiB gives ``k = 4`` for the default model on
XLA:CPU); the plan's table is printed. All five arms use that ``k``.

By default each batch is sorted by length before it is cut into
micro-batches (as length-bucketing loaders do), so micro-batches hold very
different numbers of real tokens and the mean-of-means error shows.

The arms run in lockstep (step ``i`` of every arm before step ``i + 1`` of
any), so the load of a shared machine hits them alike.

Then (unless ``--no-adaptive``) the question of how large ``k`` should be.
Three more arms see the same stream of micro-batches (``batch_size / k``
sequences each, not sorted by length), as many examples in total as above,
token-weighted, with Adam and the same learning-rate schedule:

* ``small_k``: windows of ``--k-small`` micro-batches (many small steps);
* ``large_k``: windows of ``--k-large`` (few large steps);
* ``adaptive_k``: ``accumulate(adaptive_k(k_small, k_large,
  fraction=--fraction), ...)``: each window holds ``fraction`` times the
  estimated gradient noise scale ``B_noise`` (in micro-batches),
  re-evaluated on the traced state at window boundaries, so one compiled step
  serves every window length.

Every arm tracks the noise scale, so each plots its own estimate along its
own trajectory. The learning rate warms up over 5% and decays (cosine) to 10%
of ``--lr``, counted in **examples** by default (``--schedule-unit
examples``): ``gradient_noise.scale_by_schedule_in_examples`` is the
recipe, since an adaptive run does not know its number of steps in advance. With
``--schedule-unit steps`` the inner optimizer counts its own steps instead
(optax's default), over the steps each fixed arm takes (for the adaptive arm,
the steps it would take at ``k_small``).

The output folder (default ``demo_out/``) gets ``results.json``,
``loss_curves.png``, ``memory.png`` and ``adaptive_k.png`` (loss against
examples seen, and the ``B_noise`` estimates with the adaptive
window); two tables are printed at the end.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

import optax_accum as oa
from optax_accum.gradient_noise import scale_by_schedule_in_examples
from optax_accum.microbatching import microbatched

try:
  from flax import nnx
except ImportError as e:  # pragma: no cover - depends on the environment
  raise ImportError(
      "optax_accum.demo needs Flax. Install the demo extra: pip install 'optax_accum[demo]'."
  ) from e

PAD = 0
UNK = 1
CHARS = "\n\t" + "".join(chr(c) for c in range(32, 127))
VOCAB_SIZE = 128  # PAD, UNK and the characters above, rounded up
_CHAR_TO_ID = {c: i + 2 for i, c in enumerate(CHARS)}

ARMS = ("full_batch", "accumulate", "accumulate_bf16", "microbatched", "mean_of_means")
ARM_LABELS = {
    "full_batch": "full batch",
    "accumulate": "accumulate (weighted)",
    "accumulate_bf16": "accumulate (bf16 buffer)",
    "microbatched": "microbatched (weighted)",
    "mean_of_means": "mean of means (naive)",
}


@dataclasses.dataclass(frozen=True)
class Config:
  """The demo's settings, one per command-line flag."""

  steps: int = 300
  k: int | None = None  # None: plan_k chooses it under memory_limit_mib
  batch_size: int = 32
  seq_len: int = 64
  d_model: int = 64
  layers: int = 2
  heads: int = 4
  lr: float = 3e-3
  seed: int = 0
  unit: str = "line"
  max_files: int = 40
  eval_batches: int = 8
  group_by_length: bool = True
  out: str = "demo_out"
  progress: bool = True
  adaptive: bool = True
  k_small: int = 2
  k_large: int = 16
  fraction: float = 1.0
  min_windows: int = oa.gradient_noise.MIN_WINDOWS
  schedule_unit: str = "examples"
  memory_limit_mib: float = 16.0


# ----------------------------------------------------------------------------- data

def encode(text: str, length: int) -> np.ndarray:
  """Character ids of ``text``, cut or padded with ``PAD`` (0) to ``length``.

  Characters outside printable ASCII (plus newline and tab) map to ``UNK`` (1).

  Example:
    >>> from optax_accum.demo import encode
    >>> encode("ab\\n", 5).tolist()
    [69, 70, 2, 0, 0]
  """
  ids = [_CHAR_TO_ID.get(c, UNK) for c in text[:length]]
  out = np.full(length, PAD, np.int32)
  out[: len(ids)] = ids
  return out


def split_text(text: str, max_chars: int, unit: str = "line") -> list[str]:
  """Lines (or blank-line separated paragraphs) with at least 2 visible characters.

  Trailing whitespace is dropped and each piece is cut to ``max_chars``.

  Example:
    >>> from optax_accum.demo import split_text
    >>> src = "def f():\\n  return 1\\n\\n\\nx = 2\\n"
    >>> split_text(src, 100)
    ['def f():', '  return 1', 'x = 2']
    >>> split_text(src, 100, unit="paragraph")
    ['def f():\\n  return 1', 'x = 2']
  """
  if unit == "line":
    pieces = text.splitlines()
  elif unit == "paragraph":
    pieces = [p.strip("\n") for p in re.split(r"\n[ \t]*\n", text)]
  else:
    raise ValueError(f"`unit` must be 'line' or 'paragraph'; got {unit!r}.")
  return [p.rstrip()[:max_chars] for p in pieces if len(p.strip()) >= 2]


def load_corpus(max_chars: int, max_files: int, unit: str = "line",
                root: str | None = None) -> list[str]:
  """Text pieces from the first ``max_files`` ``.py`` files of the standard library.

  Files are taken in sorted order from ``root`` (default: the folder of the
  ``os`` module), so the corpus is the same on every run with the same Python.
  """
  root = root or os.path.dirname(os.__file__)
  files = sorted(f for f in os.listdir(root) if f.endswith(".py"))[:max_files]
  pieces: list[str] = []
  for name in files:
    with open(os.path.join(root, name), encoding="utf-8", errors="replace") as f:
      pieces.extend(split_text(f.read(), max_chars, unit))
  if not pieces:
    raise RuntimeError(f"No text found in {root}; raise `--max-files`.")
  return pieces


def make_batches(pieces: list[str], cfg: Config, num_batches: int, seed: int,
                 ) -> dict[str, np.ndarray]:
  """``num_batches`` batches: ``inputs``/``targets`` int32, ``mask`` float32, each [n, B, L].

  Pieces are shuffled (epochs repeat in a new order). With
  ``cfg.group_by_length`` each batch is sorted by length, so its contiguous
  micro-batches hold very different numbers of real tokens.
  """
  rng = np.random.default_rng(seed)
  need = num_batches * cfg.batch_size
  order: list[int] = []
  while len(order) < need:
    order.extend(rng.permutation(len(pieces)).tolist())
  seqs = np.stack([encode(pieces[i], cfg.seq_len + 1) for i in order[:need]])
  seqs = seqs.reshape(num_batches, cfg.batch_size, cfg.seq_len + 1)
  if cfg.group_by_length:
    lengths = (seqs != PAD).sum(-1)
    seqs = np.take_along_axis(seqs, np.argsort(lengths, axis=1, kind="stable")[..., None], 1)
  targets = seqs[..., 1:]
  return {
      "inputs": seqs[..., :-1].astype(np.int32),
      "targets": targets.astype(np.int32),
      "mask": (targets != PAD).astype(np.float32),
  }


def _host_micro(batches: dict[str, np.ndarray], i: int, j: int, k: int) -> dict[str, np.ndarray]:
  """Micro-batch ``j`` of ``k`` (contiguous rows) of batch ``i``, on the host."""
  size = batches["inputs"].shape[1] // k
  return {name: v[i, j * size:(j + 1) * size] for name, v in batches.items()}


# ----------------------------------------------------------------------------- model

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
  """A small decoder-only character language model.

  Example:
    >>> import jax.numpy as jnp
    >>> from flax import nnx
    >>> from optax_accum.demo import CharTransformer
    >>> model = CharTransformer(seq_len=8, d_model=16, layers=1, heads=2, rngs=nnx.Rngs(0))
    >>> model(jnp.zeros((2, 8), jnp.int32)).shape
    (2, 8, 128)
  """

  def __init__(self, *, seq_len: int, d_model: int, layers: int, heads: int,
               rngs: nnx.Rngs) -> None:
    self.embed = nnx.Embed(VOCAB_SIZE, d_model, rngs=rngs)
    self.pos = nnx.Param(0.02 * jax.random.normal(rngs.params(), (seq_len, d_model)))
    self.blocks = nnx.List([Block(d_model, heads, rngs) for _ in range(layers)])
    self.ln_f = nnx.LayerNorm(d_model, rngs=rngs)
    self.head = nnx.Linear(d_model, VOCAB_SIZE, rngs=rngs)

  def __call__(self, tokens: jax.Array) -> jax.Array:
    x = self.embed(tokens) + self.pos[...][: tokens.shape[1]]
    # A causal mask suffices: padding sits at the end, so no real token sees it.
    mask = nnx.make_causal_mask(tokens)
    for block in self.blocks:
      x = block(x, mask)
    return self.head(self.ln_f(x))


# ------------------------------------------------------------------ how many micro-batches

def batch_types(cfg: Config) -> dict[str, jax.ShapeDtypeStruct]:
  """The types of one global batch (``inputs``, ``targets``, ``mask``): nothing allocated."""
  shape = (cfg.batch_size, cfg.seq_len)
  return {"inputs": jax.ShapeDtypeStruct(shape, jnp.int32),
          "targets": jax.ShapeDtypeStruct(shape, jnp.int32),
          "mask": jax.ShapeDtypeStruct(shape, jnp.float32)}


def plan_micro_batches(cfg: Config, loss_terms: LossTerms, params: Any) -> oa.planning.Plan:
  """The smallest ``k`` whose compiled ``microbatched`` arm fits ``cfg.memory_limit_mib``.

  The candidates are the divisors of ``cfg.batch_size``; each is compiled on
  ``jax.ShapeDtypeStruct`` arguments (the global batch, Adam's state) and
  nothing runs.
  """
  base = optax.adam(cfg.lr)

  def make_step(k: int) -> Callable[..., Any]:
    return build_step("microbatched", loss_terms, base, k)[1]

  return oa.plan_k(make_step, params, jax.eval_shape(base.init, params), batch_types(cfg),
                   batch_argnums=2, memory_limit=int(cfg.memory_limit_mib * 2**20))


def choose_k(cfg: Config, loss_terms: LossTerms, params: Any
             ) -> tuple[Config, oa.planning.Plan | None]:
  """``cfg`` with its ``k`` set: as given, or planned (and the plan printed)."""
  if cfg.k is not None:
    return cfg, None
  print(f"choosing k: the smallest whose compiled microbatched step fits"
        f" {cfg.memory_limit_mib:g} MiB per device (--memory-limit) ...", flush=True)
  plan = plan_micro_batches(cfg, loss_terms, params)
  print(plan, flush=True)
  return dataclasses.replace(cfg, k=plan.k), plan


def plan_summary(plan: oa.planning.Plan | None) -> dict[str, Any] | None:
  """The plan as JSON (``results["plan"]``), or None when ``--k`` was given."""
  if plan is None:
    return None
  return {"k": plan.k, "micro_batch_size": plan.micro_batch_size,
          "peak_bytes": plan.peak_bytes, "memory_limit": plan.memory_limit,
          "monotone": plan.monotone, "candidates": list(plan.candidates),
          "compile_s": plan.compile_s, "table": [row._asdict() for row in plan.table]}


# ----------------------------------------------------------------------------- the five arms

LossTerms = Callable[[Any, dict[str, jax.Array]], tuple[jax.Array, jax.Array]]


def make_loss_terms(graphdef: Any) -> LossTerms:
  """``(params, batch) -> (sum of per-token CE over real tokens, number of real tokens)``."""
  def loss_terms(params: Any, batch: dict[str, jax.Array]) -> tuple[jax.Array, jax.Array]:
    logits = nnx.merge(graphdef, params)(batch["inputs"]).astype(jnp.float32)
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"])
    return jnp.sum(ce * batch["mask"]), jnp.sum(batch["mask"])
  return loss_terms


def _own_mean(loss_terms: LossTerms) -> Callable[..., Any]:
  """The batch's own mean over its real tokens, with ``(sum, count)`` as aux."""
  def loss(params: Any, batch: dict[str, jax.Array]) -> tuple[jax.Array, Any]:
    total, count = loss_terms(params, batch)
    return total / jnp.maximum(count, 1.0), (total, count)
  return loss


def build_step(arm: str, loss_terms: LossTerms, base: optax.GradientTransformation,
               k: int) -> tuple[optax.GradientTransformation, Callable[..., Any], int]:
  """``(tx, step, calls_per_batch)`` for one arm.

  ``step(params, opt_state, batch) -> (params, opt_state, loss_sum, tokens)``
  is called ``calls_per_batch`` times per global batch, on micro-batches when
  that is ``k``.
  """
  if arm == "full_batch":
    grad_fn = jax.value_and_grad(_own_mean(loss_terms), has_aux=True)

    def step(params, opt_state, batch):
      (_, (total, count)), grads = grad_fn(params, batch)
      updates, opt_state = base.update(grads, opt_state, params)
      return optax.apply_updates(params, updates), opt_state, total, count
    return base, step, 1

  if arm in ("accumulate", "accumulate_bf16", "mean_of_means"):
    weighted = arm != "mean_of_means"
    tx = oa.accumulate(k, base, reduction="weighted" if weighted else "mean",
                       accumulator_dtype=jnp.bfloat16 if arm == "accumulate_bf16" else None)
    grad_fn = jax.value_and_grad(_own_mean(loss_terms), has_aux=True)

    def step(params, opt_state, micro):
      (_, (total, count)), grads = grad_fn(params, micro)
      # accumulate: sum_i n_i g_i / sum_i n_i, the full batch's gradient (bf16: to rounding).
      # mean_of_means: sum_i g_i / k, every micro-batch's mean weighted alike.
      extra = {"weight": count} if weighted else {}
      updates, opt_state = tx.update(grads, opt_state, params, **extra)
      return optax.apply_updates(params, updates), opt_state, total, count
    return tx, step, k

  if arm == "microbatched":
    grad_fn = microbatched(jax.value_and_grad(loss_terms, has_aux=True), k,
                           normalize="weighted")

    def step(params, opt_state, batch):
      loss, grads = grad_fn(params, batch)  # sum_i s_i / sum_i n_i, and its gradient
      updates, opt_state = base.update(grads, opt_state, params)
      count = jnp.sum(batch["mask"])
      return optax.apply_updates(params, updates), opt_state, loss * count, count
    return base, step, 1

  raise ValueError(f"`arm` must be one of {ARMS}; got {arm!r}.")


def _temp_bytes(compiled: Any) -> int | None:
  try:
    return int(compiled.memory_analysis().temp_size_in_bytes)
  except Exception:  # memory_analysis is backend-dependent
    return None


@dataclasses.dataclass
class _Arm:
  """One arm's compiled step, training state and measurements."""

  name: str
  calls: int
  compiled: Any
  params: Any
  opt_state: Any
  compile_s: float
  losses: list[float] = dataclasses.field(default_factory=list)
  step_s: list[float] = dataclasses.field(default_factory=list)
  tokens: float = 0.0


def setup_arm(arm: str, cfg: Config, loss_terms: LossTerms, params0: Any,
              batches: dict[str, np.ndarray]) -> _Arm:
  """Builds and compiles one arm's step and runs it once (a discarded warm-up)."""
  tx, step, calls = build_step(arm, loss_terms, optax.adam(cfg.lr), cfg.k)
  opt_state = jax.jit(tx.init)(params0)  # one compilation, not one per eager op
  example = jax.tree.map(jnp.asarray, _host_micro(batches, 0, 0, calls))
  t0 = time.perf_counter()
  compiled = jax.jit(step).lower(params0, opt_state, example).compile()
  jax.block_until_ready(compiled(params0, opt_state, example))  # warm-up, discarded
  return _Arm(arm, calls, compiled, params0, opt_state, time.perf_counter() - t0)


def train_step(a: _Arm, batches: dict[str, np.ndarray], i: int) -> None:
  """One optimizer step of arm ``a`` on global batch ``i`` (``a.calls`` jitted calls)."""
  t0 = time.perf_counter()
  total = count = 0.0
  for j in range(a.calls):
    micro = jax.tree.map(jnp.asarray, _host_micro(batches, i, j, a.calls))
    a.params, a.opt_state, s, n = a.compiled(a.params, a.opt_state, micro)
    total, count = total + s, count + n
  total, count = float(total), float(count)  # waits for the step to finish
  a.step_s.append(time.perf_counter() - t0)
  a.losses.append(total / max(count, 1.0))
  a.tokens += count


def _summarise(a: _Arm, evaluate: Callable[..., Any], eval_batches: dict[str, np.ndarray],
               ) -> dict[str, Any]:
  ev_sum = ev_count = 0.0
  for i in range(eval_batches["inputs"].shape[0]):
    s, n = evaluate(a.params, jax.tree.map(jnp.asarray, _host_micro(eval_batches, i, 0, 1)))
    ev_sum, ev_count = ev_sum + float(s), ev_count + float(n)
  tail = a.losses[-min(10, len(a.losses)):]
  train_s = float(np.sum(a.step_s))
  return {
      "label": ARM_LABELS[a.name],
      "losses": a.losses,
      "final_loss": float(np.mean(tail)),
      "eval_loss": ev_sum / max(ev_count, 1.0),
      # Median step time: robust to the bursts of load on a shared machine.
      "tokens_per_s": a.tokens / len(a.step_s) / float(np.median(a.step_s)),
      "tokens_per_s_overall": a.tokens / train_s,
      "median_step_s": float(np.median(a.step_s)),
      "real_tokens": a.tokens,
      "temp_bytes": _temp_bytes(a.compiled),
      "compile_s": a.compile_s,
      "train_s": train_s,
      "calls_per_step": a.calls,
  }


def _progress(cfg: Config) -> Any:
  if not cfg.progress:
    return None
  from tqdm.auto import tqdm

  return tqdm(total=cfg.steps, desc=f"training {len(ARMS)} arms", unit="step", dynamic_ncols=True)


# ----------------------------------------------------------------------------- adaptive k

ADAPTIVE_ARMS = ("small_k", "large_k", "adaptive_k")
ADAPTIVE_COLORS = {"small_k": "tab:orange", "large_k": "tab:purple", "adaptive_k": "tab:blue"}
EVAL_POINTS = 6  # eval-loss checkpoints along the run, the last at the end


def lr_schedule(cfg: Config, horizon: float) -> optax.Schedule:
  """Linear warm-up over 5% of ``horizon``, then cosine decay to 10% of ``cfg.lr``.

  ``horizon`` is in whatever the schedule will be called with: examples or
  optimizer steps.

  Example:
    >>> from optax_accum.demo import Config, lr_schedule
    >>> f = lr_schedule(Config(lr=1.0), 1000)
    >>> float(f(0)), float(f(50)), round(float(f(1000)), 3)
    (0.0, 1.0, 0.1)
  """
  return optax.warmup_cosine_decay_schedule(
      0.0, cfg.lr, warmup_steps=max(1, round(0.05 * horizon)),
      decay_steps=max(2, round(horizon)), end_value=0.1 * cfg.lr)


def adaptive_arms(cfg: Config, n_micro: int) -> dict[str, tuple[Any, optax.GradientTransformation]]:
  """``{arm: (k, accumulate transform)}``; each tracks the noise scale, token-weighted."""
  b = cfg.batch_size // cfg.k
  policy = oa.adaptive_k(cfg.k_small, cfg.k_large, fraction=cfg.fraction,
                         min_windows=cfg.min_windows)
  arms: dict[str, tuple[Any, optax.GradientTransformation]] = {}
  for arm, k in (("small_k", cfg.k_small), ("large_k", cfg.k_large), ("adaptive_k", policy)):
    if cfg.schedule_unit == "examples":
      inner = optax.chain(optax.scale_by_adam(),
                          scale_by_schedule_in_examples(lr_schedule(cfg, n_micro * b)))
    else:  # optimizer steps: the horizon of a fixed arm; the adaptive arm's at k_small
      inner = optax.adam(lr_schedule(cfg, n_micro / (cfg.k_small if arm == "adaptive_k" else k)))
    arms[arm] = (k, oa.accumulate(k, inner, reduction="weighted", track_noise_scale=True))
  return arms


def build_adaptive_step(loss_terms: LossTerms, tx: optax.GradientTransformation,
                        by_examples: bool, min_windows: int) -> Callable[..., Any]:
  """``step(params, opt_state, micro, examples, last) -> (params, opt_state, loss_sum,
  tokens, emitted, noise_scale)``: one micro-batch, token-weighted, through the fast path.

  The noise scale (in micro-batches) is NaN until ``min_windows`` windows are in.
  """
  grad_fn = jax.value_and_grad(_own_mean(loss_terms), has_aux=True)

  def step(params, opt_state, micro, examples, last):
    (_, (total, count)), grads = grad_fn(params, micro)
    extra = {"examples": examples} if by_examples else {}
    # emit_now on the stream's last micro-batch: a short final window is still a step.
    params, opt_state = oa.update_and_apply(tx, grads, opt_state, params, weight=count,
                                            emit_now=last, **extra)
    return (params, opt_state, total, count, opt_state.emitted,
            oa.noise_scale(opt_state, min_windows))
  return step


@dataclasses.dataclass
class _AdaptiveArm:
  """One arm of the adaptive experiment: its compiled step, state and per-call outputs."""

  name: str
  k: Any
  compiled: Any
  params: Any
  opt_state: Any
  compile_s: float
  outputs: list[Any] = dataclasses.field(default_factory=list)
  evals: list[tuple[float, float]] = dataclasses.field(default_factory=list)


def _eval_loss(evaluate: Callable[..., Any], params: Any,
               eval_batches: dict[str, np.ndarray]) -> float:
  ev_sum = ev_count = 0.0
  for i in range(eval_batches["inputs"].shape[0]):
    s, n = evaluate(params, jax.tree.map(jnp.asarray, _host_micro(eval_batches, i, 0, 1)))
    ev_sum, ev_count = ev_sum + float(s), ev_count + float(n)
  return ev_sum / max(ev_count, 1.0)


def run_adaptive(cfg: Config, pieces: list[str], loss_terms: LossTerms, params0: Any,
                 eval_batches: dict[str, np.ndarray]) -> dict[str, Any]:
  """Trains the three arms of the adaptive-k experiment in lockstep; returns their summaries."""
  start = time.perf_counter()
  b = cfg.batch_size // cfg.k
  n_micro = cfg.steps * cfg.k  # as many examples as each arm of the first experiment
  stream = make_batches(pieces, dataclasses.replace(cfg, batch_size=b, group_by_length=False),
                        n_micro, cfg.seed + 2)
  by_examples = cfg.schedule_unit == "examples"
  example = jax.tree.map(jnp.asarray, {name: v[0] for name, v in stream.items()})
  arms = []
  for name, (k, tx) in adaptive_arms(cfg, n_micro).items():
    t0 = time.perf_counter()
    opt_state = jax.jit(tx.init)(params0)
    args = (params0, opt_state, example, jnp.float32(b), jnp.bool_(False))
    step = build_adaptive_step(loss_terms, tx, by_examples, cfg.min_windows)
    compiled = jax.jit(step).lower(*args).compile()
    jax.block_until_ready(compiled(*args))  # warm-up, discarded
    arms.append(_AdaptiveArm(name, k, compiled, params0, opt_state, time.perf_counter() - t0))
  evaluate = jax.jit(loss_terms)
  checkpoints = {round(n_micro * i / EVAL_POINTS) for i in range(1, EVAL_POINTS + 1)}
  bar = None
  if cfg.progress:
    from tqdm.auto import tqdm

    bar = tqdm(total=n_micro, desc="adaptive k: 3 arms", unit="micro-batch", dynamic_ncols=True)
  for j in range(n_micro):  # lockstep, as above; no per-call sync
    micro = jax.tree.map(jnp.asarray, {name: v[j] for name, v in stream.items()})
    examples, last = jnp.float32((j + 1) * b), jnp.bool_(j == n_micro - 1)
    for a in arms:
      a.params, a.opt_state, *out = a.compiled(a.params, a.opt_state, micro, examples, last)
      a.outputs.append(out)
    if j + 1 in checkpoints:
      for a in arms:
        a.evals.append(((j + 1) * b, _eval_loss(evaluate, a.params, eval_batches)))
    if bar is not None:
      bar.update(1)
  if bar is not None:
    bar.close()
  summaries = {a.name: _summarise_adaptive(a, b, n_micro) for a in arms}
  return {
      "micro_batch_sequences": b,
      "micro_batches": n_micro,
      "total_sequences": n_micro * b,
      "k_small": cfg.k_small,
      "k_large": cfg.k_large,
      "fraction": cfg.fraction,
      "min_windows": cfg.min_windows,
      "schedule_unit": cfg.schedule_unit,
      "arms": summaries,
      "wall_s": time.perf_counter() - start,
  }


def _finite_or_none(x: float) -> float | None:
  return float(x) if np.isfinite(x) else None  # JSON has no NaN


def _summarise_adaptive(a: _AdaptiveArm, b: int, n_micro: int) -> dict[str, Any]:
  out = np.asarray([[float(x) for x in o] for o in a.outputs])  # one host sync, at the end
  total, count, emitted, noise = out[:, 0], out[:, 1], out[:, 2] > 0.5, out[:, 3]
  ends = np.flatnonzero(emitted)
  starts = np.concatenate([[0], ends[:-1] + 1])
  steps = int(jnp.asarray(a.opt_state.gradient_step))
  if steps != len(ends) or ends[-1] != n_micro - 1:
    raise AssertionError(f"{a.name}: {steps} optimizer steps, {len(ends)} windows closed.")
  tail = slice(int(0.9 * n_micro), n_micro)  # the last 10% of the examples
  return {
      "label": (f"adaptive k ({a.k.k_min}..{a.k.k_max})"
                if isinstance(a.k, oa.gradient_noise.AdaptiveK) else f"k = {a.k}"),
      "optimizer_steps": steps,
      "mean_k": n_micro / steps,
      "window_k": (ends - starts + 1).tolist(),
      "window_end_sequences": ((ends + 1) * b).tolist(),
      "window_loss": [float(total[s:e + 1].sum() / max(count[s:e + 1].sum(), 1.0))
                      for s, e in zip(starts, ends, strict=True)],
      # noise_scale after each window, in micro-batches (NaN until ready) -> sequences.
      "b_noise_sequences": [_finite_or_none(x * b) for x in noise[ends]],
      "final_b_noise_sequences": _finite_or_none(noise[-1] * b),
      "train_loss_last_10pct": float(total[tail].sum() / max(count[tail].sum(), 1.0)),
      "eval_points": [e for e, _ in a.evals],
      "eval_losses": [v for _, v in a.evals],
      "eval_loss": a.evals[-1][1],
      "compile_s": a.compile_s,
  }


# ----------------------------------------------------------------------------- reporting

def _fmt_bytes(n: float | None) -> str:
  if n is None:
    return "n/a"
  for unit in ("B", "KiB", "MiB"):
    if abs(n) < 1024:
      return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
    n /= 1024
  return f"{n:.2f} GiB"


def format_table(results: dict[str, Any]) -> str:
  """The summary table printed at the end of a run (Markdown)."""
  rows = [
      "| arm | jitted calls / step | train loss (mean of last 10 steps) | eval loss |"
      " max abs loss diff vs full | tokens/s | compiled temporaries |",
      "|---|---:|---:|---:|---:|---:|---:|",
  ]
  for arm in ARMS:
    r = results["arms"][arm]
    rows.append(
        f"| {r['label']} | {r['calls_per_step']} | {r['final_loss']:.4f} |"
        f" {r['eval_loss']:.4f} | {r['max_abs_loss_diff_vs_full']:.1e} |"
        f" {r['tokens_per_s']:,.0f} | {_fmt_bytes(r['temp_bytes'])} |")
  return "\n".join(rows)


def _plot(results: dict[str, Any], out: Path) -> list[str]:
  import matplotlib

  matplotlib.use("Agg", force=True)
  import matplotlib.pyplot as plt

  cfg = results["config"]
  arms = results["arms"]
  styles = {
      "full_batch": {"color": "black", "lw": 2.5, "ls": "-"},
      "accumulate": {"color": "tab:blue", "lw": 1.5, "ls": "--"},
      "accumulate_bf16": {"color": "tab:cyan", "lw": 1.5, "ls": "-."},
      "microbatched": {"color": "tab:green", "lw": 1.5, "ls": ":"},
      "mean_of_means": {"color": "tab:red", "lw": 1.2, "ls": "-"},
  }
  title = (f"{cfg['steps']} steps, batch {cfg['batch_size']} = {cfg['k']} x"
           f" {cfg['batch_size'] // cfg['k']} sequences of <= {cfg['seq_len']} tokens,"
           f" d_model {cfg['d_model']}, {cfg['layers']} layers")

  fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
  for arm in ARMS:
    ax1.plot(np.arange(1, len(arms[arm]["losses"]) + 1), arms[arm]["losses"],
             label=arms[arm]["label"], **styles[arm])
  ax1.set_xlabel("optimizer step")
  ax1.set_ylabel("training loss (CE per real token)")
  ax1.set_title("Loss curves")
  ax1.legend()
  ax1.grid(alpha=0.3)
  full = np.asarray(arms["full_batch"]["losses"])
  for arm in ARMS[1:]:
    diff = np.abs(np.asarray(arms[arm]["losses"]) - full)
    ax2.semilogy(np.arange(1, len(diff) + 1), np.maximum(diff, 1e-9),
                 label=arms[arm]["label"], **{**styles[arm], "lw": 1.5})
  ax2.set_xlabel("optimizer step")
  ax2.set_ylabel("|loss - full-batch loss| (floored at 1e-9)")
  ax2.set_title("Deviation from the full batch")
  ax2.legend()
  ax2.grid(alpha=0.3, which="both")
  fig.suptitle(title)
  fig.tight_layout()
  curves = out / "loss_curves.png"
  fig.savefig(curves, dpi=110)
  plt.close(fig)

  fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
  labels = [arms[a]["label"].replace(" (", "\n(") for a in ARMS]
  colors = [styles[a]["color"] for a in ARMS]
  mib = [(arms[a]["temp_bytes"] or 0) / 2**20 for a in ARMS]
  bars = ax1.bar(labels, mib, color=colors)
  ax1.bar_label(bars, labels=[_fmt_bytes(arms[a]["temp_bytes"]) for a in ARMS])
  ax1.set_ylabel("MiB")
  ax1.set_title("Compiled temporaries of one jitted call")
  tps = [arms[a]["tokens_per_s"] for a in ARMS]
  bars = ax2.bar(labels, tps, color=colors)
  ax2.bar_label(bars, labels=[f"{t:,.0f}" for t in tps])
  ax2.set_ylabel("real tokens / s")
  ax2.set_title("Throughput (this machine)")
  for ax in (ax1, ax2):
    ax.tick_params(axis="x", labelsize=8)
    ax.margins(y=0.15)
  fig.suptitle(title)
  fig.tight_layout()
  memory = out / "memory.png"
  fig.savefig(memory, dpi=110)
  plt.close(fig)
  return [str(curves), str(memory)]


def format_adaptive_table(adaptive: dict[str, Any]) -> str:
  """The adaptive-k experiment's table (Markdown)."""
  b = adaptive["micro_batch_sequences"]
  rows = [
      f"| arm (micro-batches of {b} sequences) | optimizer steps | mean k |"
      f" eval loss at {adaptive['total_sequences']:,} sequences |"
      " train loss (last 10% of sequences) | final B_noise estimate (sequences) |",
      "|---|---:|---:|---:|---:|---:|",
  ]
  for arm in ADAPTIVE_ARMS:
    r = adaptive["arms"][arm]
    bn = r["final_b_noise_sequences"]
    rows.append(
        f"| {r['label']} | {r['optimizer_steps']} | {r['mean_k']:.1f} | {r['eval_loss']:.4f} |"
        f" {r['train_loss_last_10pct']:.4f} | {'n/a' if bn is None else f'{bn:.0f}'} |")
  return "\n".join(rows)


def _binned(x: np.ndarray, y: np.ndarray, w: np.ndarray, bins: int) -> tuple[np.ndarray, ...]:
  """Weighted means of ``y`` over ``bins`` equal ranges of ``x`` (empty bins dropped)."""
  edges = np.linspace(0, x.max(), bins + 1)
  idx = np.clip(np.searchsorted(edges, x, side="left") - 1, 0, bins - 1)
  sw = np.bincount(idx, w, bins)
  keep = sw > 0
  mids = 0.5 * (edges[1:] + edges[:-1])
  return mids[keep], np.bincount(idx, w * y, bins)[keep] / sw[keep]


def _plot_adaptive(results: dict[str, Any], out: Path) -> str:
  import matplotlib

  matplotlib.use("Agg", force=True)
  import matplotlib.pyplot as plt

  ad = results["adaptive"]
  b = ad["micro_batch_sequences"]
  fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
  for arm in ADAPTIVE_ARMS:
    r = ad["arms"][arm]
    color = ADAPTIVE_COLORS[arm]
    x = np.asarray(r["window_end_sequences"], float)
    k = np.asarray(r["window_k"], float)
    mx, my = _binned(x, np.asarray(r["window_loss"]), k, bins=min(40, max(2, len(x) // 2)))
    ax1.plot(mx, my, color=color, lw=1.5,
             label=f"{r['label']}: {r['optimizer_steps']} steps, mean k {r['mean_k']:.1f}")
    ax1.plot(r["eval_points"], r["eval_losses"], "o--", color=color, ms=4, lw=0.8)
    bn = np.asarray([np.nan if v is None else v for v in r["b_noise_sequences"]])
    ax2.plot(x, bn, color=color, lw=1.0, alpha=0.8, label=f"B_noise estimate, {r['label']}")
    if arm == "adaptive_k":  # (without the last window: the end of the data cuts it short)
      ax2.step(x[:-1], k[:-1] * b, where="pre", color="black", lw=1.5,
               label=f"adaptive window: k x {b} sequences")
  ax1.set_xlabel("sequences seen")
  ax1.set_ylabel("loss (CE per real token)")
  ax1.set_title("Training loss (binned) and eval loss (o) at equal examples")
  ax1.legend(fontsize=8)
  ax1.grid(alpha=0.3)
  for name, k in (("k_small", ad["k_small"]), ("k_large", ad["k_large"])):
    ax2.axhline(k * b, color="gray", ls=":", lw=1)
    ax2.annotate(f"{name} x {b}", (0, k * b), textcoords="offset points", xytext=(2, 2),
                 fontsize=7, color="gray")
  ax2.set_yscale("log")
  ax2.set_xlabel("sequences seen")
  ax2.set_ylabel("sequences")
  ax2.set_title(f"Noise scale B_noise and the adaptive window (fraction {ad['fraction']:g})")
  ax2.legend(fontsize=8)
  ax2.grid(alpha=0.3, which="both")
  fig.suptitle(f"Same {ad['total_sequences']:,} sequences in micro-batches of {b}; learning"
               f" rate counted in {ad['schedule_unit']}")
  fig.tight_layout()
  path = out / "adaptive_k.png"
  fig.savefig(path, dpi=110)
  plt.close(fig)
  return str(path)


# ----------------------------------------------------------------------------- main

def parse_args(argv: Sequence[str] | None) -> Config:
  """The demo's command line, as a :class:`Config`.

  Example:
    >>> from optax_accum.demo import parse_args
    >>> parse_args(["--steps", "10", "--k", "2"]).batch_size
    32
  """
  d = Config()
  p = argparse.ArgumentParser(
      prog="python -m optax_accum.demo",
      description="Train a small Flax NNX character-level transformer on the Python"
      " standard library's source five ways (full batch, accumulate, accumulate with a"
      " bf16 buffer, microbatched, naive mean of means) and compare loss, speed and memory.")
  p.add_argument("--steps", type=int, default=d.steps, help="optimizer steps per arm")
  p.add_argument("--k", type=int, default=None,
                 help="micro-batches per optimizer step (default: the smallest whose compiled"
                 " step fits --memory-limit, chosen by optax_accum.plan_k)")
  p.add_argument("--memory-limit", dest="memory_limit_mib", type=float, default=None,
                 help=f"MiB per device for plan_k's choice of k (default {d.memory_limit_mib:g},"
                 " which gives k = 4 for the default model on XLA:CPU); not with --k")
  p.add_argument("--batch-size", type=int, default=d.batch_size,
                 help="sequences per optimizer step (the large batch); divisible by k")
  p.add_argument("--seq-len", type=int, default=d.seq_len, help="tokens per sequence")
  p.add_argument("--d-model", type=int, default=d.d_model, help="model width")
  p.add_argument("--layers", type=int, default=d.layers, help="transformer blocks")
  p.add_argument("--heads", type=int, default=d.heads, help="attention heads")
  p.add_argument("--lr", type=float, default=d.lr, help="Adam learning rate")
  p.add_argument("--seed", type=int, default=d.seed, help="init and data-order seed")
  p.add_argument("--unit", choices=("line", "paragraph"), default=d.unit,
                 help="one training sequence per source line or per paragraph")
  p.add_argument("--max-files", type=int, default=d.max_files,
                 help="standard-library .py files to read (sorted by name)")
  p.add_argument("--eval-batches", type=int, default=d.eval_batches,
                 help="held-out batches for the final eval loss")
  p.add_argument("--group-by-length", action=argparse.BooleanOptionalAction,
                 default=d.group_by_length,
                 help="sort each batch by length before cutting micro-batches, as"
                 " length-bucketing loaders do")
  p.add_argument("--adaptive", action=argparse.BooleanOptionalAction, default=d.adaptive,
                 help="also run the adaptive-k experiment (fixed small k, fixed large k,"
                 " k from the gradient noise scale)")
  p.add_argument("--k-small", type=int, default=d.k_small,
                 help="adaptive experiment: the small fixed k, and adaptive k's minimum")
  p.add_argument("--k-large", type=int, default=d.k_large,
                 help="adaptive experiment: the large fixed k, and adaptive k's maximum")
  p.add_argument("--fraction", type=float, default=d.fraction,
                 help="adaptive k aims at this fraction of the noise scale")
  p.add_argument("--min-windows", type=int, default=d.min_windows,
                 help="windows folded in before the noise-scale estimate drives k")
  p.add_argument("--schedule-unit", choices=("examples", "steps"), default=d.schedule_unit,
                 help="adaptive experiment: count the learning-rate schedule in examples"
                 " seen or in optimizer steps")
  p.add_argument("--out", default=d.out, help="output folder")
  p.add_argument("--no-progress", dest="progress", action="store_false",
                 help="no progress bar")
  a = p.parse_args(argv)
  if a.k is not None and a.memory_limit_mib is not None:
    p.error("pass --k (a fixed k) or --memory-limit (plan_k chooses k), not both.")
  if a.memory_limit_mib is None:
    a.memory_limit_mib = d.memory_limit_mib
  if not a.memory_limit_mib > 0:
    p.error(f"--memory-limit must be > 0 (MiB per device); got {a.memory_limit_mib}.")
  for name in ("steps", "batch_size", "seq_len", "d_model", "layers", "heads",
               "eval_batches", "max_files", "k_small", "k_large", "min_windows"):
    if getattr(a, name) < 1:
      p.error(f"--{name.replace('_', '-')} must be >= 1; got {getattr(a, name)}.")
  if a.k is not None and a.k < 1:
    p.error(f"--k must be >= 1; got {a.k}.")
  if a.k is not None and a.batch_size % a.k:
    p.error(f"--batch-size ({a.batch_size}) must be divisible by --k ({a.k}); e.g."
            f" --batch-size {a.k * max(1, a.batch_size // a.k)}.")
  if a.k_large < a.k_small:
    p.error(f"--k-large ({a.k_large}) must be >= --k-small ({a.k_small}).")
  if not a.fraction > 0:
    p.error(f"--fraction must be > 0; got {a.fraction}.")
  if a.d_model % a.heads:
    p.error(f"--d-model ({a.d_model}) must be divisible by --heads ({a.heads}).")
  return Config(**{f.name: getattr(a, f.name) for f in dataclasses.fields(Config)})


def _max_abs_diff(a: Any, b: Any) -> float:
  return float(max(np.max(np.abs(np.asarray(x) - np.asarray(y)))
                   for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)))


def run(cfg: Config) -> dict[str, Any]:
  """Runs the five arms (and the adaptive-k experiment) and writes the outputs.

  Returns the results, as in ``results.json``.
  """
  start = time.perf_counter()
  out = Path(cfg.out)
  out.mkdir(parents=True, exist_ok=True)
  pieces = load_corpus(cfg.seq_len + 1, cfg.max_files, cfg.unit)
  held_out = max(1, len(pieces) // 10)
  train_pieces = pieces[:-held_out]
  batches = make_batches(train_pieces, cfg, cfg.steps, cfg.seed)
  eval_batches = make_batches(pieces[-held_out:], cfg, cfg.eval_batches, cfg.seed + 1)
  model = CharTransformer(seq_len=cfg.seq_len, d_model=cfg.d_model, layers=cfg.layers,
                          heads=cfg.heads, rngs=nnx.Rngs(cfg.seed))
  graphdef, params0 = nnx.split(model)
  n_params = sum(x.size for x in jax.tree.leaves(params0))
  loss_terms = make_loss_terms(graphdef)
  cfg, plan = choose_k(cfg, loss_terms, params0)
  micro_tokens = batches["mask"].reshape(cfg.steps, cfg.k, -1).sum(-1)
  print(f"optax_accum demo: {len(pieces):,} {cfg.unit}s from {cfg.max_files} stdlib files,"
        f" {n_params:,} parameters, {cfg.steps} steps of {cfg.batch_size} sequences"
        f" (k={cfg.k} micro-batches of {cfg.batch_size // cfg.k}); real tokens per"
        f" micro-batch {micro_tokens.min():.0f}..{micro_tokens.max():.0f}"
        f" (padding {1 - batches['mask'].mean():.0%}).", flush=True)

  print("compiling the five steps ...", flush=True)
  runs = [setup_arm(arm, cfg, loss_terms, params0, batches) for arm in ARMS]
  _train_in_lockstep(cfg, runs, batches)

  evaluate = jax.jit(loss_terms)
  arms = {a.name: _summarise(a, evaluate, eval_batches) for a in runs}
  full = np.asarray(arms["full_batch"]["losses"])
  for a in runs:
    r = arms[a.name]
    r["max_abs_loss_diff_vs_full"] = float(np.max(np.abs(np.asarray(r["losses"]) - full)))
    r["max_abs_param_diff_vs_full"] = _max_abs_diff(a.params, runs[0].params)
  exact = max(arms[a]["max_abs_loss_diff_vs_full"] for a in ("accumulate", "microbatched"))
  naive = arms["mean_of_means"]["max_abs_loss_diff_vs_full"]
  bf16 = arms["accumulate_bf16"]
  results: dict[str, Any] = {
      "config": dataclasses.asdict(cfg),
      "plan": plan_summary(plan),
      "num_params": int(n_params),
      "num_sequences_available": len(pieces),
      "padding_fraction": float(1 - batches["mask"].mean()),
      "micro_batch_real_tokens": {"min": float(micro_tokens.min()),
                                  "max": float(micro_tokens.max())},
      "arms": arms,
      "exact_arms_max_abs_loss_diff": exact,
      "mean_of_means_max_abs_loss_diff": naive,
      "bf16_buffer_max_abs_loss_diff": bf16["max_abs_loss_diff_vs_full"],
      "bf16_buffer_eval_loss_minus_full": bf16["eval_loss"] - arms["full_batch"]["eval_loss"],
      "mean_of_means_eval_loss_minus_full": (
          arms["mean_of_means"]["eval_loss"] - arms["full_batch"]["eval_loss"]),
      "jax": {"version": jax.__version__, "backend": jax.default_backend()},
  }
  results["plots"] = _plot(results, out)
  if cfg.adaptive:
    print(f"adaptive k: {cfg.steps * cfg.k} micro-batches of {cfg.batch_size // cfg.k}"
          f" sequences, k = {cfg.k_small}, k = {cfg.k_large} and adaptive k"
          f" ({cfg.k_small}..{cfg.k_large}, fraction {cfg.fraction:g}) ...", flush=True)
    results["adaptive"] = run_adaptive(cfg, train_pieces, loss_terms, params0, eval_batches)
    results["plots"].append(_plot_adaptive(results, out))
  results["wall_s"] = time.perf_counter() - start
  with open(out / "results.json", "w") as f:
    json.dump(results, f, indent=1)

  _report(cfg, results, out)
  return results


def _train_in_lockstep(cfg: Config, runs: list[Any], batches: dict[str, np.ndarray]) -> None:
  """Step ``i`` of every arm before step ``i + 1`` of any: a shared machine's load hits all."""
  bar = _progress(cfg)
  for i in range(cfg.steps):
    for a in runs:
      train_step(a, batches, i)
    if bar is not None:
      bar.update(1)
      bar.set_postfix(loss=f"{runs[0].losses[-1]:.3f}", refresh=False)
  if bar is not None:
    bar.close()
  for a in runs:
    if a.calls > 1 and int(a.opt_state.gradient_step) != cfg.steps:
      raise AssertionError(f"{a.name}: {int(a.opt_state.gradient_step)} optimizer steps,"
                           f" expected {cfg.steps} (one per window).")


def _report(cfg: Config, results: dict[str, Any], out: Path) -> None:
  """Prints the tables and what they show."""
  exact, naive = results["exact_arms_max_abs_loss_diff"], results["mean_of_means_max_abs_loss_diff"]
  print()
  print(format_table(results))
  print()
  print(f"accumulate and microbatched vs full batch: max |loss diff| = {exact:.1e}"
        " (float rounding: the same large-batch step)")
  print(f"mean of means vs full batch:               max |loss diff| = {naive:.1e}"
        f" ({naive / max(exact, 1e-12):,.0f}x larger; eval loss"
        f" {results['mean_of_means_eval_loss_minus_full']:+.4f}): a different objective")
  print(f"accumulate with a bf16 buffer vs full:     max |loss diff| ="
        f" {results['bf16_buffer_max_abs_loss_diff']:.1e} (eval loss"
        f" {results['bf16_buffer_eval_loss_minus_full']:+.4f}): half the buffer, rounded"
        " stochastically")
  if cfg.adaptive:
    ad = results["adaptive"]
    print()
    print(format_adaptive_table(ad))
    print()
    print(f"learning rate counted in {cfg.schedule_unit}; B_noise: the noise-scale estimate"
          " times the sequences per micro-batch; adaptive k ="
          f" clip(round({cfg.fraction:g} x B_noise / {ad['micro_batch_sequences']}),"
          f" {cfg.k_small}, {cfg.k_large}), re-evaluated at each window boundary")
  print(f"wrote {out / 'results.json'}, {', '.join(results['plots'])}"
        f" in {results['wall_s']:.0f} s")


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
  """Entry point of ``python -m optax_accum.demo``; ``argv`` defaults to ``sys.argv[1:]``."""
  return run(parse_args(argv))


if __name__ == "__main__":
  main(sys.argv[1:])
