"""Causal self-attention with memory linear in the context length: the cache-free
(training / scoring) forward pass, and KV-cached decoding over the filled part of the
cache (`cached_attention`).

    out_t = sum_{s <= t, real_s} softmax_s(q_t . k_s / sqrt(d)) v_s        (per head, GQA)

`Transformer` computes it densely (a [B, H, T, T] score tensor) for short contexts; for
long ones it calls `causal_self_attention` here:

* "blocked": FlashAttention's tiling (Dao et al. 2022, arXiv 2205.14135; the loop order of
  FlashAttention-2, Dao 2023, arXiv 2307.08691) in plain JAX, so it runs on CPU, GPU and
  TPU. Queries and keys are cut into equal blocks of at most `block_size` positions
  (`block_layout`); each query block walks the key blocks up to the diagonal (blocks
  above it are skipped, not masked) with the online softmax of Milakov & Gimelshein 2018
  (arXiv 1805.02867):

      m' = max(m, max_s z_s),  l' = e^(m - m') l + sum_s e^(z_s - m'),
      acc' = e^(m - m') acc + sum_s e^(z_s - m') v_s,  out = acc / l,  lse = m + log l.

  The backward pass is a `jax.custom_vjp` that keeps only q, k, v, out and lse (O(T)) and
  recomputes each block's probabilities P = exp(z - lse):
  dV_j += P^T dO_i, dS = P * (dO_i V_j^T - rowsum(dO * O)_i), dQ_i += dS K_j / sqrt(d),
  dK_j += dS^T Q_i / sqrt(d), in one pass over (key block j, query block i >= j). Peak
  memory is O(B H T d + B H block^2) instead of O(B H T^2).
* "cudnn": `jax.nn.dot_product_attention(..., implementation="cudnn")`, the fused
  flash-attention kernel of cuDNN (NVIDIA GPUs only; it raises elsewhere).

Padding: `key_mask` [B, T] (True = real token) removes padding keys. A query that sees no
real key at all (a padding query in a left-padded row) gets a finite meaningless output,
as in the dense path.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from arl import backend

IMPLEMENTATIONS = ("auto", "dense", "blocked", "cudnn")

_MASKED = float(jnp.finfo(jnp.float32).min)


def resolve_implementation(implementation: str, seq_len: int, block_size: int) -> str:
    """The implementation a cache-free call of `seq_len` tokens runs: "auto" is "dense" up
    to one block (one block of the blocked algorithm is the dense computation with a
    custom backward, which only costs time) and "blocked" beyond."""
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"attention implementation must be one of {IMPLEMENTATIONS}, got "
                         f"{implementation!r}")
    if implementation == "auto":
        return "dense" if seq_len <= block_size else "blocked"
    return implementation


def block_layout(seq_len: int, block_size: int) -> tuple[int, int]:
    """(block c, number of blocks n) of the blocked attention over `seq_len` tokens with
    blocks of at most `block_size`:

        n = ceil(T / block_size),  c = min(block_size, 8 ceil(ceil(T / n) / 8))

    i.e. the fewest blocks, of equal size rounded up to a multiple of 8 (an aligned matmul
    dimension); c = T when one block holds the context. The n c - T padded positions are
    then fewer than 8 n (block_size a multiple of 8), not up to block_size - 1: T = 1047
    with block_size 512 runs 3 blocks of 352 (1056 positions), not of 512 (1536
    positions, 2.1x the attention work of the blocks on and below the diagonal).
    """
    ceil_div = lambda a, b: -(-a // b)
    num_blocks = ceil_div(seq_len, block_size)
    if num_blocks == 1:
        return seq_len, 1  # one block: the context itself, nothing to pad
    block = min(block_size, 8 * ceil_div(ceil_div(seq_len, num_blocks), 8))
    return block, ceil_div(seq_len, block)


def causal_self_attention(q: jax.Array, k: jax.Array, v: jax.Array,
                          key_mask: jax.Array | None = None, *, implementation: str,
                          block_size: int = 512) -> jax.Array:
    """Causal attention by sequence order. q [B, T, H, d], k and v [B, T, KV, d] (KV
    divides H: query head h uses key/value head h // (H // KV)), key_mask bool [B, T] or
    None. Returns [B, T, H, d] in q's dtype. Scores and softmax are float32; the
    probabilities are cast to v's dtype before mixing the values, as the dense path does.

    implementation: "blocked" or "cudnn" (module docstring); "cudnn_reference" runs the
    same `jax.nn.dot_product_attention` call with its XLA implementation (what the tests
    compare on machines without cuDNN).
    """
    batch, seq_len, num_heads, head_dim = q.shape
    num_kv = k.shape[2]
    if k.shape != (batch, seq_len, num_kv, head_dim) or v.shape != k.shape:
        raise ValueError(f"causal_self_attention: k and v must be [B, T, KV, d]="
                         f"({batch}, {seq_len}, KV, {head_dim}), got {k.shape}, {v.shape}")
    if num_heads % num_kv:
        raise ValueError(f"causal_self_attention: {num_kv} key/value heads must divide "
                         f"{num_heads} query heads")
    if key_mask is not None and key_mask.shape != (batch, seq_len):
        raise ValueError(f"causal_self_attention: key_mask must be [B, T]=({batch}, "
                         f"{seq_len}), got {key_mask.shape}")
    if implementation in ("cudnn", "cudnn_reference"):
        mask = None if key_mask is None else key_mask[:, None, None, :]
        return jax.nn.dot_product_attention(
            q, k, v, mask=mask, is_causal=True,
            implementation="cudnn" if implementation == "cudnn" else "xla")
    if implementation != "blocked":
        raise ValueError(f"causal_self_attention: implementation must be 'blocked', "
                         f"'cudnn' or 'cudnn_reference', got {implementation!r}")
    if not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"causal_self_attention: block_size must be a positive int, got "
                         f"{block_size!r}")
    block, num_blocks = block_layout(seq_len, block_size)
    padded = num_blocks * block
    if padded != seq_len:
        # Padded keys lie after every real query, so causality already hides them.
        pad = ((0, 0), (0, padded - seq_len), (0, 0), (0, 0))
        q, k, v = jnp.pad(q, pad), jnp.pad(k, pad), jnp.pad(v, pad)
        if key_mask is not None:
            key_mask = jnp.pad(key_mask, ((0, 0), (0, padded - seq_len)))
    groups = num_heads // num_kv
    # Blocked layouts, block index leading, the G query heads of a key/value head and the
    # c queries of a block flattened into M = c * G rows (query-major): q [n, B, KV, M, d],
    # k/v [n, B, KV, c, d], mask [n, B, c] or None. Head h = kv * G + g, as in the dense
    # path.
    # With one row axis and one key axis every block product is a plain batched matmul
    # (no transposed copies of the [M, c] blocks for the backward's products).
    qb = q.reshape(batch, num_blocks, block, num_kv, groups, head_dim).transpose(
        1, 0, 3, 2, 4, 5).reshape(num_blocks, batch, num_kv, block * groups, head_dim)
    kb = k.reshape(batch, num_blocks, block, num_kv, head_dim).transpose(1, 0, 3, 2, 4)
    vb = v.reshape(batch, num_blocks, block, num_kv, head_dim).transpose(1, 0, 3, 2, 4)
    mb = None
    if key_mask is not None:
        mb = key_mask.astype(bool).reshape(batch, num_blocks, block).transpose(1, 0, 2)
    out = _blocked_attention(qb, kb, vb, mb)
    out = out.reshape(num_blocks, batch, num_kv, block, groups, head_dim).transpose(
        1, 0, 3, 2, 4, 5).reshape(batch, padded, num_heads, head_dim)
    return out[:, :seq_len]


def cached_attention(q: jax.Array, all_keys: jax.Array, all_values: jax.Array,
                     layer_index, query_slots: jax.Array, *, block_size: int) -> jax.Array:
    """Attention of T new queries over one layer of a KV cache, reading only the filled
    part of the cache.

        out_t = sum_{s <= slot_t} softmax_s(q_t . k_s / sqrt(d)) v_s

    The cache's S slots are cut into blocks of min(block_size, S) and a `fori_loop`
    visits blocks 0 .. ceil((max_b,t slot[b, t] + 1) / block) - 1 with the online
    softmax of the module docstring, so a decoding step costs O(filled) instead of
    O(S): a multi-turn rollout whose static buffer is sized for its longest context no
    longer attends over the empty tail at every token. Each block is sliced from the
    stacked cache directly (no copy of the whole layer); the last block is clamped
    into the buffer and its slots already counted are masked.

    Forward only (a cached call is inference: the loop's trip count is data
    dependent). The dense cached path of `Transformer` computes the same function. A
    single query per row on the CPU reads each block of the stacked cache through the
    head-pair products (`uses_head_pairs`); a per-layer cache's blocks are read as stored
    (`layer_scores`, `layer_mix`).

    Args:
      q: [B, T, H, d] queries (rotary embedding applied).
      all_keys, all_values: [L, B, S, KV, d] the cache of every layer, this call's new
        keys and values already written; read in q's dtype. Or, with `layer_index`
        None, one layer's buffers of a per-layer cache: keys [B, KV, d, S], values
        [B, KV, S, d] (`transformer.KVCache.per_layer`).
      layer_index: int scalar (may be traced), the layer to read; None for a per-layer
        cache.
      query_slots: int [B, T] the cache slot of each query; a query sees slots <= its
        own (its row's real tokens before it, and itself).
      block_size: slots per block (static).

    Returns:
      [B, T, H, d] in q's dtype. Scores, softmax statistics and the accumulation are
      float32; the probabilities are cast to q's dtype before mixing the values, as in
      the dense path.
    """
    batch, q_len, num_heads, head_dim = q.shape
    one_layer = layer_index is None
    if one_layer:
        cache_batch, num_kv, cache_dim, capacity = all_keys.shape
        layout_ok = all_values.shape == (cache_batch, num_kv, capacity, cache_dim)
        expected = f"keys [B={batch}, KV, d={head_dim}, S] and values [B, KV, S, d]"
    else:
        _, cache_batch, capacity, num_kv, cache_dim = all_keys.shape
        layout_ok = all_values.shape == all_keys.shape
        expected = f"[L, B={batch}, S, KV, d={head_dim}]"
    if (cache_batch, cache_dim) != (batch, head_dim) or not layout_ok:
        raise ValueError(f"cached_attention: the cache must be {expected}, got keys "
                         f"{all_keys.shape}, values {all_values.shape}")
    if num_heads % num_kv:
        raise ValueError(f"cached_attention: {num_kv} key/value heads must divide "
                         f"{num_heads} query heads")
    if query_slots.shape != (batch, q_len):
        raise ValueError(f"cached_attention: query_slots must be [B, T]=({batch}, {q_len}), "
                         f"got {query_slots.shape}")
    if not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"cached_attention: block_size must be a positive int, got "
                         f"{block_size!r}")
    if q_len == 0:  # an empty reply (an env without observations) reads nothing
        return jnp.zeros_like(q)
    groups = num_heads // num_kv
    block = min(block_size, capacity)
    num_blocks = -(-capacity // block)
    needed = jnp.minimum(jnp.max(query_slots) // block + 1, num_blocks).astype(jnp.int32)
    # Rows of the query-major layout [B, KV, M = T G, d]: row t G + g is query t, head
    # kv G + g (the dense path's head order).
    qm = q.reshape(batch, q_len, num_kv, groups, head_dim).transpose(0, 2, 1, 3, 4).reshape(
        batch, num_kv, q_len * groups, head_dim)
    row_slots = jnp.repeat(query_slots, groups, axis=1)[:, None, :, None]  # [B, 1, M, 1]
    scale = 1.0 / math.sqrt(head_dim)

    def read_block(start):
        """Keys and values of slots start .. start + block - 1 in q's dtype: [B, KV, d, c]
        and [B, KV, c, d] from one layer's buffers, [B, c, KV, d] from the stacked cache."""
        if one_layer:
            keys = jax.lax.dynamic_slice(all_keys, (0, 0, 0, start),
                                         (batch, num_kv, head_dim, block))
            values = jax.lax.dynamic_slice(all_values, (0, 0, start, 0),
                                           (batch, num_kv, block, head_dim))
            return keys.astype(q.dtype), values.astype(q.dtype)
        sizes = (1, batch, block, num_kv, head_dim)
        return tuple(jax.lax.dynamic_slice(cache, (layer_index, 0, start, 0, 0), sizes)[0]
                     .astype(q.dtype) for cache in (all_keys, all_values))

    head_pairs = not one_layer and uses_head_pairs(q_len)  # then each block is read as stored
    q_grouped = q.reshape(batch, 1, num_kv, groups, head_dim) if head_pairs else None

    def key_block(j, carry):
        m, l, acc = carry
        first = j * block
        start = jnp.minimum(first, capacity - block)
        slots = start + jnp.arange(block)
        keys, values = read_block(start)
        if one_layer:
            s = layer_scores(qm, keys) * scale  # [B, KV, M, c]
        elif head_pairs:
            s = scores_every_head_pair(q_grouped, keys).reshape(batch, num_kv, groups,
                                                                 block) * scale
        else:
            s = jax.lax.dot_general(qm, keys, (((3,), (3,)), ((0, 1), (0, 2))),
                                    preferred_element_type=jnp.float32) * scale  # [B, KV, M, c]
        allowed = (slots >= first) & (slots <= row_slots)
        s = jnp.where(allowed, s, _MASKED)
        m_new = jnp.maximum(m, jnp.max(s, axis=-1))
        p = jnp.exp(s - m_new[..., None])
        alpha = jnp.exp(m - m_new)
        l = alpha * l + jnp.sum(p, axis=-1)
        if one_layer:
            pv = layer_mix(p.astype(q.dtype), values, preferred_element_type=jnp.float32)
        elif head_pairs:
            pv = mix_every_head_pair(p.astype(q.dtype).reshape(batch, num_kv, groups, 1, block),
                                     values, preferred_element_type=jnp.float32
                                     ).reshape(qm.shape)
        else:
            pv = jax.lax.dot_general(p.astype(q.dtype), values,
                                     (((3,), (1,)), ((0, 1), (0, 2))),
                                     preferred_element_type=jnp.float32)  # [B, KV, M, d]
        return m_new, l, alpha[..., None] * acc + pv

    shape = qm.shape[:-1]
    init = (jnp.full(shape, _MASKED, jnp.float32), jnp.zeros(shape, jnp.float32),
            jnp.zeros(qm.shape, jnp.float32))
    _, l, acc = jax.lax.fori_loop(0, needed, key_block, init)
    # Slot 0 is in the first block and every query sees it: l > 0.
    out = (acc / l[..., None]).astype(q.dtype)
    return out.reshape(batch, num_kv, q_len, groups, head_dim).transpose(0, 2, 1, 3, 4).reshape(
        batch, q_len, num_heads, head_dim)


def uses_head_pairs(q_len: int) -> bool:
    """Whether cached attention of `q_len` queries per row takes the head-pair products
    (`scores_every_head_pair`, `mix_every_head_pair`): for a single decoded token on the
    CPU. Prefill, training and accelerators keep the grouped products."""
    return backend.decode_attention_over_head_pairs(q_len)


def scores_every_head_pair(q: jax.Array, keys: jax.Array) -> jax.Array:
    """Grouped-query scores `einsum("btkgd,bskd->bkgts", q, keys)` in float32, computed
    from the products of every query head with every key/value head.

    q [B, T, KV, G, d]; keys [B, S, KV, d], a layer of the KV cache as it is stored.
    Returns [B, KV, G, T, S].

    XLA:CPU runs a batched matrix product with its batch dimensions leading, so the
    grouped einsum (batch dimensions B and KV, with S between them in the cache) copies the
    layer's keys transposed before the product. Here the keys are read as they are: one
    product over B alone gives every (query head, key/value head) pair, [B, T KV G, S, KV],
    and the pairs whose heads match are kept. That is KV times the scores' FLOPs, which
    for a decoded token (T = 1) cost less than the copy: the decode attention measured
    1.2x-1.9x faster from the toy model to Llama-3-8B's heads (docs/performance.md,
    "Attention and the update").
    """
    batch, q_len, num_kv, groups, head_dim = q.shape
    slots = keys.shape[1]
    # Keys as [B, S KV, d] (a reshape, not a copy); faster than the same product with the
    # keys kept four-dimensional at head dimension 128.
    every = jax.lax.dot_general(q.reshape(batch, q_len * num_kv * groups, head_dim),
                                keys.reshape(batch, slots * num_kv, head_dim),
                                (((2,), (2,)), ((0,), (0,))),
                                preferred_element_type=jnp.float32)  # [B, T KV G, S KV]
    every = every.reshape(batch, q_len, num_kv, groups, slots, num_kv)
    matching = jnp.stack([every[:, :, h, :, :, h] for h in range(num_kv)], axis=2)
    return matching.transpose(0, 2, 3, 1, 4)


def mix_every_head_pair(probs: jax.Array, values: jax.Array, *,
                        preferred_element_type=None) -> jax.Array:
    """`einsum("bkgts,bskd->btkgd", probs, values)` from the products of every query head's
    probabilities with every key/value head's values (see `scores_every_head_pair`).

    probs [B, KV, G, T, S]; values [B, S, KV, d] as stored in the cache. Returns
    [B, T, KV, G, d] in `preferred_element_type` (None: the dtype of the product of probs
    and values).
    """
    batch, num_kv, groups, q_len, slots = probs.shape
    rows = probs.transpose(0, 3, 1, 2, 4).reshape(batch, q_len * num_kv * groups, slots)
    every = jax.lax.dot_general(rows, values, (((2,), (1,)), ((0,), (0,))),
                                preferred_element_type=preferred_element_type)  # [B, M, KV, d]
    every = every.reshape(batch, q_len, num_kv, groups, num_kv, values.shape[-1])
    return jnp.stack([every[:, :, h, :, h, :] for h in range(num_kv)], axis=2)


def layer_scores(q: jax.Array, keys: jax.Array) -> jax.Array:
    """float32 scores [B, KV, M, S] of q [B, KV, M, d] (M query rows per key/value head)
    against one layer of a per-layer cache's keys [B, KV, d, S]: a batched product over
    (B, KV) that reads the keys as stored (its right operand is [d, S] per batch entry),
    where the stacked cache's [B, S, KV, d] layer needs a transposed copy or the products
    of every head pair (`scores_every_head_pair`). A broadcast multiply summed over d
    measured no faster on the CPU for a decoded token.
    """
    return jax.lax.dot_general(q, keys, (((3,), (2,)), ((0, 1), (0, 1))),
                               preferred_element_type=jnp.float32)


def layer_mix(probs: jax.Array, values: jax.Array, *, preferred_element_type=None) -> jax.Array:
    """probs [B, KV, M, S] times one layer of a per-layer cache's values [B, KV, S, d]
    -> [B, KV, M, d] (a batched product over (B, KV), the values read as stored)."""
    return jax.lax.dot_general(probs, values, (((3,), (2,)), ((0, 1), (0, 1))),
                               preferred_element_type=preferred_element_type)


def grouped_scores(q: jax.Array, keys: jax.Array, *, head_pairs: bool) -> jax.Array:
    """float32 scores [B, KV, G, T, S] of q [B, T, KV, G, d] against keys [B, S, KV, d]:
    through `scores_every_head_pair` when `head_pairs`, else the grouped einsum."""
    if head_pairs:
        return scores_every_head_pair(q, keys)
    return jnp.einsum("btkgd,bskd->bkgts", q, keys, preferred_element_type=jnp.float32)


def grouped_mix(probs: jax.Array, values: jax.Array, *, head_pairs: bool) -> jax.Array:
    """probs [B, KV, G, T, S] times values [B, S, KV, d] -> [B, T, KV, G, d]: through
    `mix_every_head_pair` when `head_pairs`, else the grouped einsum."""
    if head_pairs:
        return mix_every_head_pair(probs, values)
    return jnp.einsum("bkgts,bskd->btkgd", probs, values)


def _matmul(x, y, contract_x: int, contract_y: int):
    """Batched (over the two leading axes) product of two [B, KV, ., .] blocks, float32
    accumulation, contracting axis `contract_x` of x with `contract_y` of y."""
    return jax.lax.dot_general(x, y, (((contract_x,), (contract_y,)), ((0, 1), (0, 1))),
                               preferred_element_type=jnp.float32)


def _block_scores(q_i, k_j, mask_j, diagonal: bool):
    """float32 scores [B, KV, M, c] of a query block (M = c * G rows) against a key block
    at or before it, masked: padding keys (mask_j [B, c], None = no padding) and, on the
    diagonal block, keys after the query. Blocks below the diagonal without padding need
    no mask at all (most of them: the select is skipped)."""
    scale = 1.0 / math.sqrt(q_i.shape[-1])
    s = _matmul(q_i, k_j, 3, 3) * scale
    allowed = None
    if diagonal:
        c = k_j.shape[2]
        rows = jnp.arange(q_i.shape[2]) // (q_i.shape[2] // c)  # the query of each row
        allowed = (jnp.arange(c)[None, :] <= rows[:, None])[None, None]  # [1, 1, M, c]
    if mask_j is not None:
        padding = mask_j[:, None, None, :]
        allowed = padding if allowed is None else allowed & padding
    return s if allowed is None else jnp.where(allowed, s, _MASKED)


def _key_block(mb, j):
    return None if mb is None else mb[j]


def _forward(qb, kb, vb, mb):
    """(out [n, B, KV, M, d] in q's dtype, lse float32 [n, B, KV, M])."""
    num_blocks = qb.shape[0]

    def query_block(args):
        q_i, i = args
        shape = q_i.shape[:-1]  # [B, KV, M]

        def key_block(j, carry, diagonal=False):
            m, l, acc = carry
            s = _block_scores(q_i, kb[j], _key_block(mb, j), diagonal)
            m_new = jnp.maximum(m, jnp.max(s, axis=-1))
            p = jnp.exp(s - m_new[..., None])
            alpha = jnp.exp(m - m_new)
            l = alpha * l + jnp.sum(p, axis=-1)
            pv = _matmul(p.astype(vb.dtype), vb[j], 3, 2)
            return m_new, l, alpha[..., None] * acc + pv

        init = (jnp.full(shape, _MASKED, jnp.float32), jnp.zeros(shape, jnp.float32),
                jnp.zeros(q_i.shape, jnp.float32))
        carry = jax.lax.fori_loop(0, i, key_block, init)  # blocks below the diagonal
        m, l, acc = key_block(i, carry, diagonal=True)
        return (acc / l[..., None]).astype(qb.dtype), m + jnp.log(l)

    return jax.lax.map(query_block, (qb, jnp.arange(num_blocks)))


@jax.custom_vjp
def _blocked_attention(qb, kb, vb, mb):
    return _forward(qb, kb, vb, mb)[0]


def _blocked_attention_fwd(qb, kb, vb, mb):
    out, lse = _forward(qb, kb, vb, mb)
    return out, (qb, kb, vb, mb, out, lse)


def _blocked_attention_bwd(residuals, d_out):
    qb, kb, vb, mb, out, lse = residuals
    num_blocks = qb.shape[0]
    scale = 1.0 / math.sqrt(qb.shape[-1])
    # D_i = rowsum(dO_i * O_i): the softmax backward's per-row correction.
    delta = jnp.sum(d_out.astype(jnp.float32) * out.astype(jnp.float32), axis=-1)

    def key_block(dq, args):
        k_j, v_j, mask_j, j = args

        def query_block(i, carry, diagonal=False):
            dq, dk, dv = carry
            q_i, do_i = qb[i], d_out[i].astype(vb.dtype)
            s = _block_scores(q_i, k_j, mask_j, diagonal)
            p = jnp.exp(s - lse[i][..., None])  # [B, KV, M, c]
            dv = dv + _matmul(p.astype(vb.dtype), do_i, 2, 2)
            ds = p * (_matmul(do_i, v_j, 3, 3) - delta[i][..., None]) * scale
            dq = jax.lax.dynamic_update_index_in_dim(
                dq, dq[i] + _matmul(ds.astype(kb.dtype), k_j, 3, 2), i, 0)
            dk = dk + _matmul(ds.astype(qb.dtype), q_i, 2, 2)
            return dq, dk, dv

        zeros = jnp.zeros(k_j.shape, jnp.float32)
        carry = query_block(j, (dq, zeros, zeros), diagonal=True)
        dq, dk, dv = jax.lax.fori_loop(j + 1, num_blocks, query_block, carry)  # below it
        return dq, (dk, dv)

    dq, (dk, dv) = jax.lax.scan(key_block, jnp.zeros(qb.shape, jnp.float32),
                                (kb, vb, mb, jnp.arange(num_blocks)))
    return dq.astype(qb.dtype), dk.astype(kb.dtype), dv.astype(vb.dtype), None


_blocked_attention.defvjp(_blocked_attention_fwd, _blocked_attention_bwd)
