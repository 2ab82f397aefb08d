"""Fingerprints of the programs `Transformer` lowers to, one per kind of call.

    python tests/models/lowered_programs.py > before.txt     # e.g. on main
    python tests/models/lowered_programs.py --compare before.txt

A refactoring of arl/models that claims to leave every computation as it was runs this
before and after: each line is a kind of call (training pass and its gradient, padding
masks, explicit positions, cached prefill and decoding on both cache layouts, the
after-prefix and return_kv pair, projection recording and reuse, the blocked kernels,
`generate`) and the SHA-256 of its lowered StableHLO text (no debug locations). Equal
hashes mean the same program, operation for operation. The text depends on the JAX
version, so compare two runs under the same installation, never a stored file across
installations.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp

from arl.models import sampling
from arl.models import transformer as transformer_lib
from arl.models.transformer import Transformer, TransformerConfig

CONFIG = TransformerConfig(vocab_size=64, d_model=32, num_layers=2, num_heads=4,
                           num_kv_heads=2, mlp_dim=64, max_len=32, value_head=True)
# Eight-token blocks: a 12-token call pads its last block; a 32-slot cache has 4 blocks.
BLOCKED = dataclasses.replace(CONFIG, attention="blocked", attention_block=8)
PER_LAYER = dataclasses.replace(CONFIG, layer_unroll=CONFIG.num_layers)
TRAINING = dataclasses.replace(CONFIG, remat=True, layer_unroll=2)
BATCH, LENGTH = 2, 12


def _params(config):
    model = Transformer(config)
    params = nn.unbox(jax.jit(model.init)(jax.random.key(0),
                                          jnp.zeros((1, 1), jnp.int32))["params"])
    return model, params


def _inputs():
    tokens = jax.random.randint(jax.random.key(1), (BATCH, LENGTH), 0, CONFIG.vocab_size)
    mask = jnp.arange(LENGTH)[None, :] >= jnp.array([[0], [3]])  # row 1 left-padded
    positions = jnp.broadcast_to(jnp.arange(LENGTH, dtype=jnp.int32) + 5, (BATCH, LENGTH))
    num_valid = jnp.array([LENGTH, 7], jnp.int32)
    return tokens, mask, positions, num_valid


def _prefilled(model, params, config, tokens, record=False):
    cache = transformer_lib.init_cache(config, BATCH, record_projections=record)
    return model.apply({"params": params}, tokens, cache, method="decode").cache


def _loss(out):
    return jnp.sum(out.logits) + jnp.sum(out.values)


def calls():
    """{name: (function, arguments)}: every kind of call, unjitted."""
    tokens, mask, positions, num_valid = _inputs()
    model, params = _params(CONFIG)
    blocked_model, _ = _params(BLOCKED)
    per_layer_model, _ = _params(PER_LAYER)
    training_model, _ = _params(TRAINING)
    apply = lambda m=model, **kw: (lambda p, *a: m.apply({"params": p}, *a, **kw))

    def decode(m=model, *names):
        """(params, tokens, cache, *values) -> the cached call with keyword `names` set to
        `values`."""
        return lambda p, t, c, *values: m.apply({"params": p}, t, c, method="decode",
                                                **dict(zip(names, values)))

    cache = transformer_lib.init_cache(CONFIG, BATCH)
    filled = _prefilled(model, params, CONFIG, tokens)
    recording = transformer_lib.init_cache(CONFIG, BATCH, record_projections=True)
    layer_params = transformer_lib.per_layer_params(params)
    head, rest = tokens[:, :5], tokens[:, 5:]
    prefix = model.apply({"params": params}, head, return_kv=True).cache
    projections = model.apply({"params": params}, tokens, return_projections=True).projections
    one = tokens[:, :1]
    last_logits = jnp.zeros((BATCH, CONFIG.vocab_size), jnp.float32)

    def grad(m, **kw):
        return jax.grad(lambda p, t: _loss(m.apply({"params": p}, t, **kw)))

    def generate(m):
        return lambda p, c, key: sampling.generate(
            m, p, c, last_logits, key, max_new_tokens=4, eot_id=1, pad_id=0)

    key = jax.random.key(2)
    return {
        "plain": (apply(), (params, tokens)),
        "plain gradient": (grad(model), (params, tokens)),
        "training gradient (remat, unrolled)": (grad(training_model), (params, tokens)),
        "mask": (apply(attention_mask=mask), (params, tokens)),
        "positions": (apply(positions=positions), (params, tokens)),
        "no logits, hidden": (apply(compute_logits=False, return_hidden=True),
                              (params, tokens)),
        "cached prefill": (decode(), (params, tokens, cache)),
        "cached num_valid": (decode(model, "num_valid"), (params, tokens, cache, num_valid)),
        "cached mask": (decode(model, "attention_mask"), (params, tokens, cache, mask)),
        "cached positions": (decode(model, "positions"), (params, tokens, cache, positions)),
        "cached decode token": (decode(model, "num_valid"), (params, one, filled, num_valid)),
        "per-layer cache": (decode(model, "num_valid"),
                            (layer_params, one, filled.per_layer(), num_valid)),
        "per-layer cache, stacked params": (decode(), (params, tokens, cache.per_layer())),
        "recording": (decode(model, "num_valid"), (params, tokens, recording, num_valid)),
        "recording, per-layer cache": (decode(model, "num_valid"),
                                       (layer_params, tokens, recording.per_layer(),
                                        num_valid)),
        "return_kv": (apply(return_kv=True, return_hidden=True, compute_logits=False),
                      (params, head)),
        "prefix_kv": (lambda p, t, kv: model.apply({"params": p}, t, prefix_kv=kv),
                      (params, rest, prefix)),
        "prefix_kv gradient": (
            jax.grad(lambda p, t, k, v: _loss(model.apply(
                {"params": p}, t, prefix_kv=prefix.replace(keys=k, values=v))),
                argnums=(0, 2, 3)),
            (params, rest, prefix.keys, prefix.values)),
        "return_projections": (apply(return_projections=True), (params, tokens)),
        "stored projections' gradient": (
            jax.grad(lambda p, t, s: _loss(model.apply({"params": p}, t, projections=s))),
            (params, tokens, projections)),
        "blocked with mask": (apply(blocked_model, attention_mask=mask), (params, tokens)),
        "blocked gradient": (grad(blocked_model), (params, tokens)),
        "blocked prefix_kv": (
            lambda p, t, kv: blocked_model.apply({"params": p}, t, prefix_kv=kv),
            (params, rest, prefix)),
        "blocked cached decode": (decode(blocked_model, "num_valid"),
                                  (params, one, filled, num_valid)),
        "blocked per-layer decode": (decode(blocked_model, "num_valid"),
                                     (layer_params, one, filled.per_layer(), num_valid)),
        "generate": (generate(model), (params, filled, key)),
        "generate per-layer": (generate(per_layer_model), (params, filled, key)),
    }


def fingerprints() -> dict[str, str]:
    return {name: hashlib.sha256(jax.jit(function).lower(*args).as_text().encode())
            .hexdigest()[:16]
            for name, (function, args) in calls().items()}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--compare", help="a previous run's output; exit 1 on a difference")
    args = parser.parse_args(argv)
    prints = fingerprints()
    for name, digest in prints.items():
        print(f"{digest}  {name}")
    if args.compare:
        with open(args.compare) as f:
            before = dict(reversed(line.rstrip("\n").split("  ", 1)) for line in f if line.strip())
        differ = sorted(n for n in prints.keys() | before.keys()
                        if prints.get(n) != before.get(n))
        print(f"compared with {args.compare}: " + (
            "all identical" if not differ else f"{len(differ)} differ: {differ}"),
            file=sys.stderr)
        return 1 if differ else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
