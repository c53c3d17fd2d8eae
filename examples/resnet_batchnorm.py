"""A small ResNet with BatchNorm, a target batch of 128 from 4 micro-batches of 32.

Run: ``python examples/resnet_batchnorm.py`` (``--quick`` for a few steps;
``--out DIR``, default ``examples_out/resnet_batchnorm``). On 2 CPU cores
shared with other jobs it took 167 s in all, comparing the gradients at the end
25 s of it (four programs compiled).

The job of the tutorials this package answers, in JAX: a Flax Linen ResNet
with BatchNorm on 32x32x3 images of 10 classes (synthetic: one smooth pattern
per class, shifted, recoloured and buried in noise, from a fixed seed), trained
two ways from the same start on the same batches:

* ``whole batch``: one ``apply_gradients`` per batch of 128, float32;
* ``4 x 32``: ``oa.accumulate(4, adam)`` through ``oa.flax.TrainState``, one
  jitted step per micro-batch of 32, the model computing in bfloat16 with
  float32 params (``oa.Policy``), ``nn.remat`` around each residual block.

It prints the compiled memory of one jitted step for the whole batch, 4 x 32,
+ bf16, + remat (on XLA:CPU, bf16 saves nothing: its convolutions compute in
float32, with converts around them; compiled for an H200, the peaks are 29.5,
8.8, 5.6 and 4.9 MiB, see ``docs/recipes/batchnorm.md``); the loss curves of
the two runs (``loss_curves.png``, ``results.json``) and their gap; and, at the
4 x 32 run's final params, how far the gradient ``oa.microbatched`` accumulates over 4
micro-batches is from the whole batch's, relative to its norm: with BatchNorm in
training mode, and in eval mode (the running statistics), where only float32 rounding
is left. The gap is not rounding: BatchNorm in training mode normalises each
micro-batch of 32 with its own statistics ("ghost batch norm"), so the accumulated
gradient is not the batch of 128's (see ``docs/recipes/batchnorm.md``); the running
statistics get one EMA update per micro-batch.
"""

from __future__ import annotations

import argparse
import json
import re
import time
from collections import Counter
from collections.abc import Sequence
from functools import partial
from pathlib import Path
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.flatten_util import ravel_pytree

import optax_accum as oa
from optax_accum.flax import TrainState

NUM_CLASSES, BATCH, K, MOMENTUM = 10, 128, 4, 0.9
STAGES = ((16, 1), (32, 2), (64, 2))  # (features, strides) of the residual blocks
F32 = oa.Policy()
BF16 = oa.Policy.from_string("params=float32,compute=bfloat16,output=float32")


# ----------------------------------------------------------------------------- data

class Data:
  """Class ``c`` is a smooth pattern, rolled by up to 4 pixels, with a colour shift and noise.

  The patterns come from ``seed``; each stream of images (training, held out) from its own.
  """

  def __init__(self, seed: int, stream: int) -> None:
    coarse = np.random.default_rng(seed).normal(size=(NUM_CLASSES, 4, 4, 3)).astype(np.float32)
    self.templates = np.asarray(jax.image.resize(coarse, (NUM_CLASSES, 32, 32, 3), "cubic"))
    self.rng = np.random.default_rng([seed, stream])

  def batch(self, n: int) -> dict[str, np.ndarray]:
    rng = self.rng
    label = rng.integers(NUM_CLASSES, size=n)
    shift = rng.integers(-4, 5, size=(n, 2))
    image = np.stack([np.roll(self.templates[c], tuple(s), axis=(0, 1))
                      for c, s in zip(label, shift, strict=True)])
    image += rng.normal(0, 0.7, (n, 1, 1, 3)) + rng.normal(0, 1.5, image.shape)
    return {"image": image.astype(np.float32), "label": label.astype(np.int32)}


# ----------------------------------------------------------------------------- model

class Block(nn.Module):
  features: int
  strides: int
  train: bool

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    norm = partial(nn.BatchNorm, use_running_average=not self.train, momentum=MOMENTUM)
    y = nn.Conv(self.features, (3, 3), self.strides, use_bias=False)(x)
    y = nn.relu(norm()(y))
    y = norm(scale_init=nn.initializers.zeros)(nn.Conv(self.features, (3, 3), use_bias=False)(y))
    if x.shape != y.shape:
      x = norm()(nn.Conv(self.features, (1, 1), self.strides, use_bias=False)(x))
    return nn.relu(x + y)


class ResNet(nn.Module):
  """Stem (32x32 -> 16x16), 3 residual blocks (16x16, 8x8, 4x4), pooling, a linear head."""

  train: bool = True
  remat: bool = False

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    block = nn.remat(Block) if self.remat else Block  # the same names, the same params
    x = nn.Conv(16, (3, 3), 2, use_bias=False)(x)
    x = nn.relu(nn.BatchNorm(use_running_average=not self.train, momentum=MOMENTUM)(x))
    for i, (features, strides) in enumerate(STAGES):
      x = block(features, strides, self.train, name=f"block{i}")(x)
    return nn.Dense(NUM_CLASSES)(jnp.mean(x, axis=(1, 2)))


def make_loss(policy: oa.Policy, remat: bool) -> Any:
  """``loss_fn(params, batch, batch_stats) -> (loss, new batch_stats)`` in training mode."""
  model = ResNet(train=True, remat=remat)

  def loss_fn(params: Any, batch: dict, batch_stats: Any) -> tuple[jax.Array, Any]:
    logits, updates = model.apply(
        {"params": params, "batch_stats": batch_stats},
        policy.cast_to_compute(batch["image"]), mutable=["batch_stats"])
    loss = optax.softmax_cross_entropy_with_integer_labels(
        logits.astype(jnp.float32), batch["label"]).mean()
    return loss, updates["batch_stats"]

  # Params cast to the compute dtype, outputs to float32; the running statistics are not
  # inputs to cast (cast_inputs=False), so they stay float32.
  return oa.mixed_precision(loss_fn, policy, cast_inputs=False)


class State(TrainState):
  batch_stats: Any


def make_step(policy: oa.Policy, remat: bool) -> Any:
  """One ``apply_gradients`` on a batch (the whole batch, or one micro-batch)."""
  value_and_grad = jax.value_and_grad(make_loss(policy, remat), has_aux=True)

  def step(state: State, batch: dict) -> tuple[State, jax.Array]:
    (loss, batch_stats), grads = value_and_grad(state.params, batch, state.batch_stats)
    return state.apply_gradients(grads=grads, batch_stats=batch_stats), loss

  return jax.jit(step, donate_argnums=0)


@jax.jit
def evaluate(params: Any, batch_stats: Any, batch: dict) -> tuple[jax.Array, jax.Array]:
  """Loss and accuracy in eval mode (the running statistics), float32."""
  logits = ResNet(train=False).apply({"params": params, "batch_stats": batch_stats},
                                     batch["image"])
  loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"]).mean()
  return loss, jnp.mean(jnp.argmax(logits, -1) == batch["label"])


def init_state(tx: optax.GradientTransformation) -> State:
  variables = ResNet(train=False).init(jax.random.key(0), jnp.zeros((1, 32, 32, 3)))
  return State.create(apply_fn=None, params=variables["params"],
                      batch_stats=variables["batch_stats"], tx=tx)


# ----------------------------------------------------------------------------- memory

def memory_table(optimizer: optax.GradientTransformation, accumulated: optax.GradientTransformation,
                 batch: dict) -> tuple[dict, dict]:
  """Compiles the 4 steps; returns their memory (bytes) and the compiled steps."""
  micro = jax.tree.map(lambda v: v[:BATCH // K], batch)
  arms = {
      "whole batch of 128": (optimizer, F32, False, batch),
      "4 x 32": (accumulated, F32, False, micro),
      "4 x 32 + bf16": (accumulated, BF16, False, micro),
      "4 x 32 + bf16 + remat": (accumulated, BF16, True, micro),
  }
  memory, compiled = {}, {}
  for name, (tx, policy, remat, b) in arms.items():
    compiled[name] = make_step(policy, remat).lower(init_state(tx), b).compile()
    m = compiled[name].memory_analysis()
    memory[name] = {"temp": int(m.temp_size_in_bytes), "argument": int(m.argument_size_in_bytes),
                    "output": int(m.output_size_in_bytes), "alias": int(m.alias_size_in_bytes)}
    memory[name]["peak"] = (memory[name]["temp"] + memory[name]["argument"]
                            + memory[name]["output"] - memory[name]["alias"])
  return memory, compiled


def convolution_dtypes(compiled: Any) -> dict[str, int]:
  """The compiled program's convolutions, counted by the dtype they compute in."""
  return dict(Counter(re.findall(r"= (\w+)\[[^\]]*\]\S* convolution\(", compiled.as_text())))


def format_memory(memory: dict, bf16_convolutions: dict[str, int]) -> str:
  rows = ["| one jitted step | temp (KiB) | argument (KiB) | output (KiB) | peak (KiB) |",
          "|---|---:|---:|---:|---:|"]
  for name, m in memory.items():
    rows.append(f"| {name} | {m['temp'] / 1024:,.0f} | {m['argument'] / 1024:,.0f} |"
                f" {m['output'] / 1024:,.0f} | {m['peak'] / 1024:,.0f} |")
  rows.append("peak = argument + output + temp - alias (the state is donated: alias is the"
              " state's bytes), as XLA's memory_analysis() reports the compiled program.")
  rows.append(f"The bf16 step's compiled convolutions, by the dtype they compute in:"
              f" {bf16_convolutions}" + ("" if "bf16" in bf16_convolutions else
                                         ": none in bf16, so bf16 saves little here."))
  return "\n".join(rows)


# ----------------------------------------------------------------------------- training

def train(steps: int, eval_every: int, seed: int) -> tuple[dict, dict]:
  """Both runs on the same batches; the results and the last batch."""
  optimizer = optax.adam(2e-3)
  data, held_out = Data(seed, stream=0), Data(seed, stream=1).batch(512)
  batches = [data.batch(BATCH) for _ in range(steps)]
  accumulated = oa.accumulate(K, optimizer)
  memory, compiled = memory_table(optimizer, accumulated, batches[0])
  bf16_convolutions = convolution_dtypes(compiled["4 x 32 + bf16"])
  runs = {"whole batch": (compiled["whole batch of 128"], optimizer, 1),
          "4 x 32 (bf16, remat)": (compiled["4 x 32 + bf16 + remat"], accumulated, K)}
  results = {}
  for name, (step, tx, k) in runs.items():
    state, losses, evals = init_state(tx), [], []
    start = time.perf_counter()
    for i, batch in enumerate(batches):
      window = []
      # One jitted step per micro-batch (rows j, j + k, ...); the params move on the k-th.
      for m in [{key: v[j::k] for key, v in batch.items()} for j in range(k)]:
        state, loss = step(state, m)
        window.append(loss)
      losses.append(float(np.mean(window)))
      if (i + 1) % eval_every == 0 or i + 1 == steps:
        loss, accuracy = evaluate(state.params, state.batch_stats, held_out)
        evals.append({"step": i + 1, "loss": float(loss), "accuracy": float(accuracy)})
    results[name] = {"losses": losses, "eval": evals, "seconds": time.perf_counter() - start,
                     "optimizer_steps": int(getattr(state.opt_state, "gradient_step", state.step)),
                     "micro_steps": int(state.step)}
    results[name]["state"] = state
  results = {"memory": memory, "bf16_convolutions": bf16_convolutions, "runs": results}
  return results, batches[-1]


def gradient_gap(params: Any, batch_stats: Any, batch: dict) -> dict:
  """|g_k - g| / |g|: the gradient ``oa.microbatched`` accumulates over K micro-batches
  against the whole batch's, float32.

  With BatchNorm in training mode (each micro-batch normalised with its own statistics)
  and, for scale, in eval mode (the running statistics: no coupling, so only rounding is
  left). Matmuls and convolutions at "highest" (a TPU's default is bf16 passes).
  """
  gaps = {}
  start = time.perf_counter()
  for mode, train in (("train", True), ("eval", False)):
    model = ResNet(train=train)

    def loss_fn(params: Any, batch: dict, batch_stats: Any, model: nn.Module = model) -> Any:
      logits, _ = model.apply({"params": params, "batch_stats": batch_stats}, batch["image"],
                              mutable=["batch_stats"])
      return optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"]).mean()

    value_and_grad = jax.value_and_grad(loss_fn)
    with jax.default_matmul_precision("highest"):
      _, whole = jax.jit(value_and_grad)(params, batch, batch_stats)
      _, accumulated = jax.jit(oa.microbatched(value_and_grad, K))(params, batch, batch_stats)
    whole, accumulated = ravel_pytree(whole)[0], ravel_pytree(accumulated)[0]
    gaps[mode] = float(jnp.linalg.norm(accumulated - whole) / jnp.linalg.norm(whole))
  gaps["seconds"] = time.perf_counter() - start
  n = len(batch["label"])
  print(f"\nthe gradient of the batch of {n} against {K} x {n // K} accumulated"
        f" (|difference| / |whole|, at the 4 x 32 run's final params):\n"
        f"  BatchNorm in training mode {gaps['train']:.3g}  (each micro-batch normalised"
        f" with its own statistics)\n"
        f"  BatchNorm in eval mode     {gaps['eval']:.3g}  (the running statistics:"
        f" float32 rounding)  ({gaps['seconds']:.1f} s)")
  return gaps


def plot(results: dict, out: Path) -> Path:
  import matplotlib
  matplotlib.use("Agg", force=True)
  import matplotlib.pyplot as plt

  fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
  for (name, r), color in zip(results["runs"].items(), ("black", "tab:blue"), strict=True):
    ax1.plot(np.arange(1, len(r["losses"]) + 1), r["losses"], color=color, lw=1, label=name)
    ax2.plot([e["step"] for e in r["eval"]], [e["loss"] for e in r["eval"]], "o-",
             color=color, label=name)
  ax1.set(xlabel="optimizer step (batch of 128)", ylabel="training loss (train-mode BatchNorm)",
          title="Training loss")
  ax2.set(xlabel="optimizer step", ylabel="held-out loss (running statistics)",
          title="Held-out loss, 512 images")
  for ax in (ax1, ax2):
    ax.legend()
  fig.tight_layout()
  path = out / "loss_curves.png"
  fig.savefig(path, dpi=100)
  plt.close(fig)
  return path


def main(argv: Sequence[str] | None = None) -> dict:
  p = argparse.ArgumentParser(prog="python examples/resnet_batchnorm.py",
                              description=__doc__.split("\n")[0])
  p.add_argument("--steps", type=int, default=200, help="optimizer steps (batches of 128)")
  p.add_argument("--eval-every", type=int, default=25, help="optimizer steps between evals")
  p.add_argument("--quick", action="store_true",
                 help="6 steps and the gradients compared on 16 images, for the smoke test")
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--out", type=Path, default=Path("examples_out/resnet_batchnorm"))
  args = p.parse_args(argv)
  steps, eval_every = (6, 3) if args.quick else (args.steps, args.eval_every)
  start = time.perf_counter()
  results, last_batch = train(steps, eval_every, args.seed)
  print(format_memory(results["memory"], results["bf16_convolutions"]))

  runs = results["runs"]
  whole, accumulated = runs["whole batch"], runs["4 x 32 (bf16, remat)"]
  tail = max(1, steps // 5)
  results["gap"] = {
      "train_loss_last_20pct": float(np.mean(accumulated["losses"][-tail:])
                                     - np.mean(whole["losses"][-tail:])),
      "eval_loss_final": accumulated["eval"][-1]["loss"] - whole["eval"][-1]["loss"],
      "eval_accuracy_final": accumulated["eval"][-1]["accuracy"] - whole["eval"][-1]["accuracy"],
  }
  print(f"\n{steps} optimizer steps of 128 images each ({K * steps} micro-steps for 4 x 32)")
  for name, r in runs.items():
    e = r["eval"][-1]
    print(f"  {name:22s} train loss (last {tail}) {np.mean(r['losses'][-tail:]):.4f}"
          f"  held-out loss {e['loss']:.4f}  accuracy {e['accuracy']:.3f}  ({r['seconds']:.1f} s)")
  gap = results["gap"]
  print(f"  gap (4 x 32 - whole): train loss {gap['train_loss_last_20pct']:+.4f},"
        f" held-out loss {gap['eval_loss_final']:+.4f},"
        f" accuracy {gap['eval_accuracy_final']:+.3f}")
  # --quick compares on 16 images, 4 per micro-batch: under the test suite's XLA flags
  # (backend optimisation level 0) XLA:CPU runs the micro-batches' scan of convolutions
  # slowly, 24 s for the batch of 128 against 2 s for 16.
  if args.quick:
    last_batch = {key: v[:16] for key, v in last_batch.items()}
  state = accumulated.pop("state")
  whole.pop("state")
  results["gradient_gap"] = gradient_gap(state.params, state.batch_stats, last_batch)

  args.out.mkdir(parents=True, exist_ok=True)
  results["config"] = {"steps": steps, "batch": BATCH, "k": K, "seed": args.seed,
                       "stages": STAGES, "momentum": MOMENTUM}
  results["seconds"] = time.perf_counter() - start
  (args.out / "results.json").write_text(json.dumps(results, indent=1))
  print(f"wrote {plot(results, args.out)} and {args.out / 'results.json'}"
        f" ({results['seconds']:.0f} s in all)")
  return results


if __name__ == "__main__":
  main()
