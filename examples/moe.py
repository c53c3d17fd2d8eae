"""A mixture-of-experts decoder trained with its load-balancing loss four ways, at k = 8.

Run ``python examples/moe.py`` (a few minutes on two CPU cores; ``--quick``
runs a tiny version in seconds; ``--help`` lists the sizes). It writes
``moe.json``, ``moe.md`` and ``moe.png`` to ``--out`` and prints the table.

The model is a Flax Linen decoder whose blocks (causal attention, then a
top-2 routed expert layer) are rematerialised (``nn.remat``). Its loss is the
next-token cross-entropy, plus the load-balancing loss ``N_E * sum_i f_i P_i``
(``f_i``: the share of the routed tokens expert ``i`` gets, a count;
``P_i``: the router's probability for expert ``i``, averaged over the
micro-batch's tokens in the loss; averaged over the layers) and the router
z-loss. The data come from 8 synthetic "domains" (Markov chains over the same
tokens) and every micro-batch holds one domain, as when each data-parallel
rank or micro-batch reads a narrow shard: balancing per micro-batch forbids
experts to specialise by domain; balancing over the whole batch allows it
(Qiu et al. 2025, arXiv 2501.11873).

The four ways differ only in where ``f`` comes from:

* ``micro-batch``: each micro-batch's own counts (what frameworks do),
  ``microbatched(fn, k)``;
* ``causal``: the counts of the window's micro-batches so far, this one
  included (Megatron's ``global_aux_loss``, the paper's Alg. 1),
  ``accumulate(k, opt, global_stats=like)`` reading ``state.global_stats.running``;
* ``lagged``: the last window's counts, ``state.global_stats.last``;
* ``exact``: the whole batch's counts, ``microbatched(fn, k,
  global_stats=stats_fn)``: a statistics pass, then the gradient pass.

Besides training, it measures how far the causal, lagged and per-micro-batch
gradients are from the exact one (on the same window), and what the
statistics pass costs (time and compiled memory).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

import optax_accum as oa
from optax_accum.microbatching import split_microbatches

MODES = ("micro-batch", "causal", "lagged", "exact")


@dataclasses.dataclass(frozen=True)
class Config:
  steps: int = 300
  k: int = 8
  rows: int = 8  # per micro-batch: a batch of k * rows sequences
  seq_len: int = 32
  vocab: int = 64
  domains: int = 8
  d_model: int = 32
  d_ff: int = 64
  layers: int = 2
  experts: int = 8
  top_k: int = 2
  balance: float = 0.1  # the load-balancing loss's coefficient (0.01: see the recipe)
  z_loss: float = 1e-3
  lr: float = 3e-3
  eval_batches: int = 4
  cost_batches: int = 21  # timed steps of the statistics pass's cost (the first one dropped)
  quick: bool = False
  seed: int = 0
  out: str = "moe_out"


# ------------------------------------------------------------------------------ data
def domain_chains(cfg: Config) -> np.ndarray:
  """Per domain, a Markov chain over the tokens: 4 likely successors of each token."""
  rng = np.random.default_rng(cfg.seed)
  chains = np.full((cfg.domains, cfg.vocab, cfg.vocab), 0.02 / cfg.vocab)
  for d in range(cfg.domains):
    for t in range(cfg.vocab):
      chains[d, t, rng.choice(cfg.vocab, 4, replace=False)] += rng.dirichlet(np.ones(4)) * 0.98
  return chains / chains.sum(-1, keepdims=True)


def sample_batch(cfg: Config, chains: np.ndarray, rng: np.random.Generator) -> np.ndarray:
  """A batch of ``k * rows`` sequences; micro-batch ``i`` (rows ``i, i + k, ...``) is one domain."""
  domain = np.resize(rng.permutation(cfg.domains), cfg.k)[np.arange(cfg.k * cfg.rows) % cfg.k]
  tokens = np.zeros((cfg.k * cfg.rows, cfg.seq_len), np.int32)
  tokens[:, 0] = rng.integers(0, cfg.vocab, len(tokens))
  cum = chains.cumsum(-1)
  for t in range(1, cfg.seq_len):
    u = rng.random(len(tokens))[:, None]
    tokens[:, t] = (cum[domain, tokens[:, t - 1]] < u).sum(-1).clip(max=cfg.vocab - 1)
  return tokens


# ----------------------------------------------------------------------------- model
class MoE(nn.Module):
  """Top-k routed experts (every expert computed densely: small enough here)."""

  cfg: Config

  @nn.compact
  def __call__(self, x: jax.Array) -> tuple[jax.Array, dict[str, jax.Array]]:
    c = self.cfg
    logits = nn.Dense(c.experts, use_bias=False, name="router")(x)
    probs = jax.nn.softmax(logits)
    top, chosen = lax.top_k(probs, c.top_k)
    one_hot = jax.nn.one_hot(chosen, c.experts)  # [B, T, top_k, E]
    gates = jnp.einsum("btk,btke->bte", top / top.sum(-1, keepdims=True), one_hot)
    init = nn.initializers.lecun_normal(batch_axis=(0,))
    w1 = self.param("w1", init, (c.experts, x.shape[-1], c.d_ff))
    w2 = self.param("w2", init, (c.experts, c.d_ff, x.shape[-1]))
    y = jnp.einsum("btef,efd->bted", jax.nn.gelu(jnp.einsum("btd,edf->btef", x, w1)), w2)
    routed = {"counts": one_hot.sum((0, 1, 2)), "probs": probs.sum((0, 1)),
              "z": jnp.sum(jax.nn.logsumexp(logits, -1) ** 2)}
    return jnp.einsum("bte,bted->btd", gates, y), routed


class Block(nn.Module):
  cfg: Config

  @nn.compact
  def __call__(self, x: jax.Array) -> tuple[jax.Array, dict[str, jax.Array]]:
    mask = nn.make_causal_mask(jnp.ones(x.shape[:2]))
    x = x + nn.MultiHeadDotProductAttention(num_heads=2, deterministic=True)(
        nn.LayerNorm()(x), mask=mask)
    y, routed = MoE(self.cfg)(nn.LayerNorm()(x))
    return x + y, routed


class Decoder(nn.Module):
  """Returns the logits and, per layer, the router's counts, probability sums and z sums."""

  cfg: Config

  def setup(self) -> None:
    c = self.cfg
    self.embed = nn.Embed(c.vocab, c.d_model)
    self.pos = self.param("pos", nn.initializers.normal(0.02), (c.seq_len, c.d_model))
    # Rematerialised: the backward pass recomputes each block's forward, routing included.
    self.blocks = [nn.remat(Block)(c) for _ in range(c.layers)]
    self.norm, self.head = nn.LayerNorm(), nn.Dense(c.vocab)

  def __call__(self, tokens: jax.Array, layers: int | None = None) -> tuple[Any, Any]:
    x, routed = self.embed(tokens) + self.pos[:tokens.shape[1]], []
    for block in self.blocks[:layers]:
      x, r = block(x)
      routed.append(r)
    routed = jax.tree.map(lambda *r: jnp.stack(r), *routed)  # [layers, ...]
    return (self.head(self.norm(x)) if layers is None else None), routed


# ------------------------------------------------------------------------------ loss
def make_losses(cfg: Config, model: Decoder) -> dict[str, Callable[..., Any]]:
  """The loss of one micro-batch given ``f``'s counts, and the statistics function."""
  def loss(params: Any, tokens: jax.Array, counts: Callable[[Any], Any] = lambda own: own,
           ) -> tuple[jax.Array, Any]:
    """Cross-entropy + balance + z-loss; ``f`` from ``counts(own)`` ([layers, E]), where
    ``own`` is this micro-batch's counts, from the same forward."""
    logits, routed = model.apply(params, tokens)
    ce = optax.softmax_cross_entropy_with_integer_labels(logits[:, :-1], tokens[:, 1:]).mean()
    own = lax.stop_gradient(routed["counts"])
    c = counts(own)
    f = c / jnp.maximum(c.sum(-1, keepdims=True), 1)  # shares: each layer's row sums to 1
    p = routed["probs"] / tokens.size  # this micro-batch's mean probabilities (differentiable)
    balance = cfg.experts * jnp.sum(f * p) / cfg.layers
    z = routed["z"].sum() / (tokens.size * cfg.layers)
    total = ce + cfg.balance * balance + cfg.z_loss * z
    return total, {"ce": ce, "balance": balance, "counts": own}

  def stats_fn(params: Any, tokens: jax.Array) -> dict[str, jax.Array]:
    """Every layer's expert counts: the model up to its last router (the head is dropped)."""
    return {"counts": model.apply(params, tokens, layers=cfg.layers)[1]["counts"]}

  def early_stats(params: Any, tokens: jax.Array) -> dict[str, jax.Array]:
    """The first layer's counts only: the statistics pass stops after the first block."""
    return {"counts": model.apply(params, tokens, layers=1)[1]["counts"]}

  def fixed(counts: jax.Array) -> Callable[[Any], Any]:
    return lambda own: counts

  return {"loss": loss, "stats": stats_fn, "early_stats": early_stats,
          "ce": jax.jit(lambda p, t: loss(p, t)[1]["ce"]),
          "grad": jax.jit(jax.grad(lambda p, t, c: loss(p, t, fixed(c))[0])),
          "balance_grad": jax.jit(jax.grad(lambda p, t, c: loss(p, t, fixed(c))[1]["balance"])),
          "counts": jax.jit(lambda p, t: stats_fn(p, t)["counts"])}


# ---------------------------------------------------------------------------- steps
AUX_RULES = {"ce": "mean", "balance": "mean", "counts": "stack"}


def in_step(cfg: Config, losses: dict[str, Any], tx: Any, mode: str) -> Callable[..., Any]:
  """One optimizer step on the whole batch, ``microbatched``: ``micro-batch``, ``exact``, or
  ``early`` (the first layer's counts the whole batch's, the others each micro-batch's)."""
  loss = losses["loss"]
  if mode == "micro-batch":
    fn = oa.microbatched(jax.value_and_grad(loss, has_aux=True), cfg.k, has_aux=True,
                         aux_rules=AUX_RULES)
  else:
    stats = losses["stats"] if mode == "exact" else losses["early_stats"]

    def with_stats(params: Any, tokens: jax.Array, stats: Any) -> Any:
      whole = stats["counts"]  # early statistics: the later layers take their own counts
      return loss(params, tokens, lambda own: own.at[:whole.shape[0]].set(whole))
    fn = oa.microbatched(jax.value_and_grad(with_stats, has_aux=True), cfg.k, has_aux=True,
                         aux_rules=AUX_RULES, global_stats=stats)

  @jax.jit
  def step(params: Any, opt_state: Any, tokens: jax.Array) -> tuple[Any, Any, Any]:
    (_, aux), grads = fn(params, tokens)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, aux
  return step


def across_steps(cfg: Config, losses: dict[str, Any], tx: Any, mode: str) -> Callable[..., Any]:
  """One micro-step of ``accumulate(k, opt, global_stats=...)``: ``causal`` or ``lagged``."""
  loss = losses["loss"]

  @jax.jit
  def micro_step(params: Any, state: Any, tokens: jax.Array) -> tuple[Any, Any, Any]:
    running, last = state.global_stats.running["counts"], state.global_stats.last["counts"]

    def counts(own: jax.Array) -> jax.Array:
      if mode == "causal":  # the window's micro-batches so far, this one included
        return running + own
      return jnp.where(last.sum() > 0, last, own)  # the first window has no last one
    (_, aux), grads = jax.value_and_grad(loss, has_aux=True)(params, tokens, counts)
    params, state = oa.update_and_apply(tx, grads, state, params, stats={"counts": aux["counts"]})
    return params, state, aux
  return micro_step


# -------------------------------------------------------------------------- training
def loads(counts: np.ndarray) -> tuple[float, float]:
  """Max/mean expert load ``[k, layers, E]`` counts: over the whole batch, and per micro-batch."""
  whole = counts.sum(0)
  return (float(np.mean(whole.max(-1) / whole.mean(-1))),
          float(np.mean(counts.max(-1) / counts.mean(-1))))


def train(cfg: Config, mode: str, params: Any, batches: list[np.ndarray],
          losses: dict[str, Any], steps: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
  """Trains one mode on ``batches``; the curves and the step times."""
  adam = optax.adam(cfg.lr)
  history: dict[str, list[float]] = {"ce": [], "load": [], "micro_load": [], "seconds": []}
  if mode in ("causal", "lagged"):
    like = jax.eval_shape(losses["stats"], params, batches[0][:cfg.rows])
    tx = oa.accumulate(cfg.k, adam, global_stats=like)
    step, state = across_steps(cfg, losses, tx, mode), tx.init(params)
  else:
    step, state = steps[mode], adam.init(params)
  for tokens in batches:
    start = time.perf_counter()
    if mode in ("causal", "lagged"):
      auxes = []
      for micro in split_microbatches(jnp.asarray(tokens), cfg.k):
        params, state, aux = step(params, state, micro)
        auxes.append(aux)
      aux = jax.tree.map(lambda *a: jnp.stack(a), *auxes)
    else:
      params, state, aux = step(params, state, jnp.asarray(tokens))
    aux = jax.block_until_ready(jax.device_get(aux))
    history["seconds"].append(time.perf_counter() - start)
    load, micro_load = loads(np.asarray(aux["counts"]))
    history["ce"].append(float(np.mean(aux["ce"])))
    history["load"].append(load)
    history["micro_load"].append(micro_load)
  return params, history


def evaluate(params: Any, batches: list[np.ndarray], losses: dict[str, Any]) -> float:
  return float(np.mean([losses["ce"](params, jnp.asarray(t)) for t in batches]))


# ------------------------------------------------------------- distance and cost
def distances(cfg: Config, params: Any, previous: np.ndarray, tokens: np.ndarray,
              losses: dict[str, Any]) -> dict[str, dict[str, float]]:
  """How far each mode's gradient is from the exact one, on the window ``tokens``.

  The gradient of the whole loss and of the balancing term alone, as
  ``|g_mode - g_exact| / |g_exact|``; the lagged counts are ``previous``'s.
  """
  micro = list(split_microbatches(jnp.asarray(tokens), cfg.k))
  own = [losses["counts"](params, m) for m in micro]
  last = sum(losses["counts"](params, m) for m in split_microbatches(jnp.asarray(previous), cfg.k))
  counts = {"micro-batch": own, "causal": list(np.cumsum(np.stack(own), 0)),
            "lagged": [last] * cfg.k, "exact": [sum(own)] * cfg.k}
  out = {}
  for name, g in (("total", losses["grad"]), ("balance", losses["balance_grad"])):
    mean = {m: jax.tree.map(lambda *x: sum(x) / cfg.k, *[g(params, t, c) for t, c in zip(
        micro, counts[m], strict=True)]) for m in MODES}
    norm = lambda tree: float(np.sqrt(sum(np.sum(np.square(x)) for x in jax.tree.leaves(tree))))
    out[name] = {m: norm(jax.tree.map(jnp.subtract, mean[m], mean["exact"])) / norm(
        mean["exact"]) for m in MODES if m != "exact"}
  return out


def check_exact(cfg: Config, params: Any, tokens: np.ndarray, losses: dict[str, Any]) -> float:
  """The exact mode's gradient against the whole batch's (statistics as constants): max rel."""
  loss = losses["loss"]
  def given(stats: Any) -> Callable[[Any], Any]:
    return lambda own: stats["counts"]
  fn = oa.microbatched(jax.value_and_grad(lambda p, t, stats: loss(p, t, given(stats))[0]),
                       cfg.k, global_stats=losses["stats"])
  _, got = jax.jit(fn)(params, jnp.asarray(tokens))
  _, want = jax.jit(jax.value_and_grad(lambda p, t: loss(p, t, given(lax.stop_gradient(
      losses["stats"](p, t))))[0]))(params, jnp.asarray(tokens))
  return float(max(np.max(np.abs(a - b)) for a, b in zip(
      jax.tree.leaves(got), jax.tree.leaves(want), strict=True)) / max(
          np.max(np.abs(b)) for b in jax.tree.leaves(want)))


def cost(cfg: Config, params: Any, batches: list[np.ndarray], steps: dict[str, Any],
         names: Sequence[str]) -> dict:
  """The statistics pass's cost: step time and compiled temporaries, with and without it.

  Each step (``names``: ``micro-batch``, ``exact``, ``early``) alternates with the
  others over ``batches``, so that a load on the machine falls on all alike.
  """
  adam = optax.adam(cfg.lr)
  state = adam.init(params)
  compiled = {n: steps[n].lower(params, state, jnp.asarray(batches[0])).compile() for n in names}
  times: dict[str, list[float]] = {n: [] for n in names}
  for t in batches:
    for n in names:
      start = time.perf_counter()
      jax.block_until_ready(compiled[n](params, state, jnp.asarray(t)))
      times[n].append(time.perf_counter() - start)
  out = {n: {"ms": 1e3 * float(np.median(times[n][1:])), "temp_bytes": int(getattr(
      compiled[n].memory_analysis(), "temp_size_in_bytes", 0))} for n in names}
  for n in names:
    out[n]["time_ratio"] = out[n]["ms"] / out["micro-batch"]["ms"]
  return out


# --------------------------------------------------------------------------- output
def table(results: dict[str, Any]) -> str:
  apis = {"micro-batch": "`microbatched(fn, k)`", "exact": "`microbatched(..., global_stats=)`",
          "causal": "`accumulate(..., global_stats=)`: `running`",
          "lagged": "`accumulate(..., global_stats=)`: `last`"}
  lines = ["| mode | API | final train CE | eval CE | max/mean load, batch | max/mean load,"
           " micro-batch | step time (ms) |", "|---|---|---|---|---|---|---|"]
  for m in MODES:
    r = results["modes"][m]
    lines.append(f"| {m} | {apis[m]} | {r['final_ce']:.4f} | {r['eval_ce']:.4f} |"
                 f" {r['load']:.3f} | {r['micro_load']:.3f} | {r['step_ms']:.1f} |")
  return "\n".join(lines)


def plot(results: dict[str, Any], path: Path) -> None:
  import matplotlib
  matplotlib.use("Agg", force=True)
  import matplotlib.pyplot as plt

  fig, axes = plt.subplots(1, 3, figsize=(15, 4))
  smooth = lambda x: np.convolve(x, np.ones(min(10, len(x))) / min(10, len(x)), "valid")
  for m in MODES:
    h = results["modes"][m]["history"]
    for ax, key in zip(axes, ("ce", "load", "micro_load"), strict=True):
      ax.plot(smooth(h[key]), label=m)
  titles = ("train cross-entropy", "max/mean expert load, whole batch",
            "max/mean expert load, per micro-batch (one domain)")
  for ax, title in zip(axes, titles, strict=True):
    ax.set_title(title)
    ax.set_xlabel("optimizer step")
  axes[0].legend()
  fig.tight_layout()
  fig.savefig(path, dpi=100)
  plt.close(fig)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
  cfg = parse_args(argv)
  model = Decoder(cfg)
  chains, rng = domain_chains(cfg), np.random.default_rng(cfg.seed + 1)
  batches = [sample_batch(cfg, chains, rng) for _ in range(cfg.steps + 1)]
  held_out = [sample_batch(cfg, chains, rng) for _ in range(cfg.eval_batches)]
  params0 = model.init(jax.random.key(cfg.seed), jnp.asarray(batches[0][:1]))
  losses = make_losses(cfg, model)
  adam = optax.adam(cfg.lr)
  steps = {m: in_step(cfg, losses, adam, m) for m in ("micro-batch", "exact", "early")}
  results: dict[str, Any] = {"config": dataclasses.asdict(cfg), "modes": {}}
  for m in MODES:
    params, history = train(cfg, m, params0, batches[1:], losses, steps)
    tail = max(1, cfg.steps // 10)
    results["modes"][m] = {
        "final_ce": float(np.mean(history["ce"][-tail:])),
        "eval_ce": evaluate(params, held_out, losses),
        "load": float(np.mean(history["load"][-tail:])),
        "micro_load": float(np.mean(history["micro_load"][-tail:])),
        "step_ms": 1e3 * float(np.median(history["seconds"][1:] or history["seconds"])),
        "history": history}
    if m == "exact":
      trained = params
  results["distance"] = {"at init": distances(cfg, params0, batches[0], batches[1], losses),
                         "trained": distances(cfg, trained, held_out[0], held_out[1], losses)}
  results["exact_vs_whole_batch"] = check_exact(cfg, trained, held_out[0], losses)
  timed = ("micro-batch", "exact") if cfg.quick else ("micro-batch", "exact", "early")
  results["cost"] = cost(cfg, params0, batches[:cfg.cost_batches], steps, timed)
  out = Path(cfg.out)
  out.mkdir(parents=True, exist_ok=True)
  (out / "moe.json").write_text(json.dumps(results, indent=1))
  (out / "moe.md").write_text(report(results))
  plot(results, out / "moe.png")
  print(report(results))
  return results


def report(results: dict[str, Any]) -> str:
  d, c = results["distance"], results["cost"]
  rows = ["| gradient | point | " + " | ".join(m for m in MODES if m != "exact") + " |",
          "|---|---|---|---|---|"]
  for point, by_term in d.items():
    for term, by_mode in by_term.items():
      rows.append(f"| {term} | {point} | " + " | ".join(
          f"{by_mode[m]:.2e}" for m in MODES if m != "exact") + " |")
  cfg = results["config"]
  return "\n".join([
      f"MoE decoder, {cfg['layers']} layers of {cfg['experts']} experts (top-{cfg['top_k']}),"
      f" k = {cfg['k']} micro-batches of {cfg['rows']} x {cfg['seq_len']} tokens,"
      f" {cfg['steps']} steps; the last 10% of steps averaged.", "", table(results), "",
      "Distance from the exact gradient, |g - g_exact| / |g_exact|:", "", *rows, "",
      f"Exact mode vs the whole batch (float32, max relative): "
      f"{results['exact_vs_whole_batch']:.1e}.", "",
      f"Statistics pass: step {c['exact']['ms']:.1f} ms vs {c['micro-batch']['ms']:.1f} ms"
      f" without (x{c['exact']['time_ratio']:.2f})" + (
          f"; first layer only {c['early']['ms']:.1f} ms (x{c['early']['time_ratio']:.2f})"
          if "early" in c else "") + ". Compiled temporaries:"
      f" {c['exact']['temp_bytes'] / 2**20:.2f} MiB vs"
      f" {c['micro-batch']['temp_bytes'] / 2**20:.2f} MiB.", ""])


def parse_args(argv: Sequence[str] | None) -> Config:
  d = Config()
  p = argparse.ArgumentParser(prog="python examples/moe.py", description=__doc__.split("\n")[0])
  for f in dataclasses.fields(Config):
    if f.name == "quick":
      p.add_argument("--quick", action="store_true", help="a tiny run, for the tests")
    else:
      p.add_argument(f"--{f.name.replace('_', '-')}", type=type(getattr(d, f.name)),
                     default=getattr(d, f.name))
  cfg = Config(**vars(p.parse_args(argv)))
  if cfg.quick:
    cfg = dataclasses.replace(cfg, steps=3, rows=2, seq_len=8, d_model=16, d_ff=16, layers=1,
                              eval_batches=2, cost_batches=3)
  return cfg


if __name__ == "__main__":
  main()
