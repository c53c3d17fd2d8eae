"""``microbatched``'s 0.2 options, deprecated: accepted with a ``DeprecationWarning`` until 0.4.

The deprecated ``split="contiguous"`` and ``rng_mode="split"`` only reorder
which rows and keys a micro-batch gets; an ``accumulator_dtype`` narrower than
the default rule loses precision; ``unroll`` is ``lax.scan``'s. In 0.4 this
module goes, and with it the loop's branches that read them (``_batch``'s
contiguous layout, the split keys).
"""

from __future__ import annotations

import warnings
from typing import Any

from optax_accum import _batch, _validation

DEFAULTS = {"split": "strided", "rng_mode": "fold_in", "accumulator_dtype": None, "unroll": 1}


def microbatched_options(given: dict[str, Any]) -> dict[str, Any]:
  """``microbatched``'s ``**deprecated_options``, checked: warns for each, raises for others.

  Returns the four options (their defaults where not given), as ``split``, ``rng_mode``,
  ``acc_dtype`` and ``unroll``.
  """
  unknown = sorted(set(given) - set(DEFAULTS))
  if unknown:
    raise TypeError(
        f"`microbatched` got unexpected keyword argument(s) {unknown}; it takes"
        " batch_argnums, has_aux, normalize, aux_rules, rng_argnums, axis_name,"
        " return_noise_stats and global_stats.")
  if given:
    warnings.warn(
        f"`microbatched`'s {', '.join(f'`{n}=`' for n in sorted(given))} is"
        " deprecated and goes in 0.4: micro-batches are strided rows with keys"
        " `jax.random.fold_in(key, i)`, the accumulators follow the default dtype rule"
        " (never narrower than the values) and `lax.scan` is not unrolled.",
        DeprecationWarning, stacklevel=3)
  old = {**DEFAULTS, **given}
  return dict(
      split=_batch.check_split(old["split"]),
      rng_mode=_validation.check_choice(old["rng_mode"], "rng_mode", ("fold_in", "split"),
                                        "Use 'fold_in' (default) or 'split'."),
      acc_dtype=_validation.check_accumulator_dtype(old["accumulator_dtype"]),
      unroll=old["unroll"])
