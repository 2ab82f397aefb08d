"""Decoder-only transformer language model (Llama / Qwen2 family) with a KV cache.

Architecture (Touvron et al. 2023, "LLaMA", arXiv 2302.13971; Qwen2 adds q/k/v biases,
Hugging Face Llama's `attention_bias` adds q/k/v and o_proj biases, its `mlp_bias` biases
on the three MLP projections):

    h_0 = E[tokens]
    for each layer l:
        a   = RMSNorm_l^attn(h)
        h  += o_proj(Attention(RoPE(q_proj a), RoPE(k_proj a), v_proj a))   # causal, GQA
        m   = RMSNorm_l^mlp(h)
        h  += down_proj(silu(gate_proj m) * up_proj m)                       # SwiGLU
    z = RMSNorm^final(h)
    logits = z @ W_lm   (W_lm = E^T when embeddings are tied)        -- float32
    value  = z @ w_v + b_v   (optional scalar head, the PPO critic)  -- float32

* RMSNorm(x) = x / sqrt(mean(x^2) + eps) * scale, computed in float32 (Zhang & Sennrich 2019).
* RoPE (Su et al. 2021, arXiv 2104.09864) in the "rotate-half" layout used by Hugging Face
  Llama/Qwen2: for frequencies f_i = theta^(-2i/head_dim), i < head_dim/2,
  x' = x * cos(p f) + rotate_half(x) * sin(p f), rotate_half([x1, x2]) = [-x2, x1].
  Llama 3.1+ scale the frequencies (`config.rope_scaling`, `arl.models.rope`); Qwen3
  RMS-normalises every query and key head before RoPE (`config.qk_norm`: parameters
  layers/self_attn/{q,k}_norm/scale [L, head_dim]).
* Attention scores and softmax are float32; softmax(q k^T / sqrt(head_dim) + mask).
* Grouped-query attention (Ainslie et al. 2023, arXiv 2305.13245): num_heads query heads
  share num_kv_heads key/value heads in groups of num_heads // num_kv_heads.

Parameter tree (names mirror Hugging Face so checkpoint import is a rename + reshape):

    embed_tokens/embedding                 [vocab, d_model]            ("vocab", "embed")
    layers/input_layernorm/scale           [L, d_model]                ("layers", "embed")
    layers/self_attn/q_proj/kernel         [L, d_model, H, head_dim]   ("layers", "embed", "heads", "head_dim")
    layers/self_attn/q_proj/bias           [L, H, head_dim]            (qkv_bias only)
    layers/self_attn/k_proj/kernel         [L, d_model, KV, head_dim]  ("layers", "embed", "kv_heads", "head_dim")
    layers/self_attn/v_proj/kernel         [L, d_model, KV, head_dim]
    layers/self_attn/o_proj/kernel         [L, H, head_dim, d_model]   ("layers", "heads", "head_dim", "embed")
    layers/self_attn/o_proj/bias           [L, d_model]                (o_bias only)
    layers/post_attention_layernorm/scale  [L, d_model]
    layers/mlp/gate_proj/kernel            [L, d_model, mlp_dim]       ("layers", "embed", "mlp")
    layers/mlp/up_proj/kernel              [L, d_model, mlp_dim]
    layers/mlp/down_proj/kernel            [L, mlp_dim, d_model]       ("layers", "mlp", "embed")
    layers/mlp/{gate,up}_proj/bias         [L, mlp_dim]                (mlp_bias only)
    layers/mlp/down_proj/bias              [L, d_model]                (mlp_bias only)
    norm/scale                             [d_model]
    lm_head                                [d_model, vocab]            ("embed", "vocab"), untied only
    value_head/kernel, value_head/bias     [d_model, 1], [1]           (value_head only)

The layers are stacked on a leading axis and run with `nn.scan`: one compiled layer body
whatever the depth, or `layer_unroll` layers per iteration in cache-free calls. With a
KV cache the scan carries the whole cache and each layer updates it in place. A HF tensor
`model.layers.{i}.self_attn.q_proj.weight` of shape [H*head_dim, d_model] is
`kernel[i] = weight.T.reshape(d_model, H, head_dim)`.

Positions and padding: by default token t of a row has position t (cache-free calls) or
its cache slot (cached calls), i.e. rows are left-aligned and padded at the end only.
`attention_mask` (1 = real token) handles padding anywhere, e.g. the left padding of
Hugging Face batched generation: padding is never attended to, real tokens get positions
counted over their row's real tokens only (cumsum(mask) - 1, as transformers' `generate`
does), and a cached call writes only the real tokens, packed from the row's current
length, so the cache never holds padding and decoding continues from each row's own count
of real tokens. `positions` overrides the RoPE positions (causality stays by sequence
order). Without either argument the computation is the plain one, operation for
operation.

Boxed parameters: every parameter is created through `nn.with_logical_partitioning`, so
`model.init(...)` returns `nn.LogicallyPartitioned` boxes. `model.apply` accepts boxed or
plain parameters. For optax and arithmetic, unbox once:

    variables = model.init(key, tokens)
    specs = param_partition_specs(variables["params"], LOGICAL_AXIS_RULES)   # needs the boxes
    params = nn.unbox(variables)["params"]                                  # plain arrays

`abstract_params(model)` gives the boxed shapes without allocating anything.

Separate critic: build a second `Transformer(dataclasses.replace(config, value_head=True))`
with its own parameters and use only its `values` output (its logits are simply ignored;
set `compute_logits=False` to skip the vocabulary projection). A shared-trunk critic is
the same model with `value_head=True` on the policy itself.

Beside this module: the layer (`arl.models.decoder_layer`), its attention
(`arl.models.attention`, kernels in `arl.models.attention_kernels`), RMSNorm and SwiGLU
(`arl.models.layers`), where a call's tokens sit (`arl.models.call_layout`), decoding on a
per-layer cache (`arl.models.per_layer_cache`), the hyper-parameters
(`arl.models.transformer_config`), the KV cache (`arl.models.kv_cache`), RoPE
(`arl.models.rope`) and the mesh layout of parameters and activations
(`arl.models.partitioning`); this module re-exports their public names.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import struct

from arl.models.call_layout import (CallLayout, after_prefix_layout, cache_free_layout,
                                    cached_layout, checked_mask, checked_positions)
from arl.models.decoder_layer import DecoderLayer
from arl.models.kv_cache import KVCache, check_projections, init_cache, write_projections
from arl.models.layers import RMSNorm
from arl.models.partitioning import (ACTIVATION_AXIS_RULES, LOGICAL_AXIS_RULES, LOGITS,
                                     RESIDUAL, constrain_activation, param_partition_specs,
                                     param_shardings)
from arl.models.per_layer_cache import per_layer_params, run_per_layer
from arl.models.projections import weight_init
from arl.models.rope import apply_rope, constant_rope_tables, rope_tables
from arl.models.transformer_config import (TransformerConfig, decodes_per_layer,
                                           mask_padded_vocab, projection_features)


# The model's public names, wherever they are defined (`from arl.models.transformer
# import KVCache` keeps working since the cache, the config, RoPE and the sharding rules
# moved to modules of their own).
__all__ = [
    "ACTIVATION_AXIS_RULES", "LOGICAL_AXIS_RULES", "KVCache", "ModelOutput", "RMSNorm",
    "Transformer", "TransformerConfig", "abstract_params", "apply_rope",
    "constrain_activation", "decodes_per_layer", "gather_embedding", "init_cache",
    "output_matrix", "param_partition_specs", "param_shardings", "per_layer_params",
    "projection_features", "rope_tables", "unembedding_matrix",
]


@struct.dataclass
class ModelOutput:
    """logits f32 [B, T, V] (None with compute_logits=False); values f32 [B, T] or None;
    cache: the updated cache of `Transformer.decode`, the tokens' keys and values with
    return_kv, else None; hidden [B, T, d_model] final-normed states when requested;
    projections {name: [num_layers, B, T, *features]}, the layers' projection outputs of
    the T tokens, with return_projections."""

    logits: jax.Array | None
    values: jax.Array | None
    cache: KVCache | None
    hidden: jax.Array | None = None
    projections: dict[str, jax.Array] | None = None


class Transformer(nn.Module):
    """Decoder-only LM; see the module docstring for the architecture and parameters.

    Two entry points: calling the model runs the cache-free forward pass (training,
    scoring); `decode` runs the T tokens through a KV cache and returns it updated
    (prefill and decoding: `model.apply(variables, tokens, cache, method="decode")`).
    """

    config: TransformerConfig

    def __call__(self, tokens, *, positions=None, attention_mask=None,
                 compute_logits: bool = True, return_hidden: bool = False,
                 prefix_kv: KVCache | None = None, return_kv: bool = False,
                 projections: dict[str, jax.Array] | None = None,
                 return_projections: bool = False) -> ModelOutput:
        """The forward pass over tokens int32 [B, T]: positions 0..T-1, causal attention
        over the T tokens (training / recomputation; sequences left-aligned, padding
        only at the end).

        attention_mask: optional int/bool [B, T], 1/True = real token, 0/False = padding
          anywhere in the row (left padding as Hugging Face tokenizers produce for
          batched generation, right padding, or both). Padding tokens are never attended
          to and their own outputs are meaningless (finite). Query t sees the real tokens
          s <= t. Default positions: each real token's index among its row's real tokens
          (cumsum(mask) - 1, padding 0), so a padded row scores like the same row
          unpadded.
        positions: optional int [B, T] RoPE positions of the T tokens, overriding the
          defaults above (e.g. Hugging Face `position_ids`). Causality is by sequence
          order, not by position value, as in Hugging Face.
        With neither positions nor attention_mask the computation is exactly the one
        described first (the same operations).

        compute_logits=False skips the vocabulary projection (logits None);
        return_hidden=True also returns the final-normed hidden states.

        Two more arguments let a sequence be computed in two differentiable parts (e.g. a
        prompt once, then several continuations of it):
        return_kv=True returns the T tokens' rotated keys and values as `cache`, a
          stacked `KVCache` ([L, B, T, KV, Dh], length T).
        prefix_kv: such keys and values of P earlier positions (a stacked `KVCache` of
          capacity P, every slot filled, batch B): the T tokens are positions P..P+T-1
          and attend causally over the P positions and themselves, with any
          `config.attention`. Not with positions or attention_mask.

        Projections (the reuse of a rollout's activations by its update):
        return_projections=True returns every layer's projection outputs of the T tokens
          (`ModelOutput.projections`, {name: [L, B, T, *features]}, q/k/v before RoPE).
        projections: such outputs of these T tokens: each projection takes its recorded
          output as its forward value and differentiates as the projection at that value
          (`arl.models.projections.stored_linear`), so the layers' matmuls run in the
          backward pass only. Recorded at the same parameters, the outputs are the ones
          computed here up to float summation order.

        Returns ModelOutput(logits f32 [B, T, V], values f32 [B, T] or None, the tokens'
        keys and values with return_kv (else None), hidden or None, projections or None).
        """
        cfg = self.config
        batch, seq_len = _checked_tokens(tokens)
        explicit_positions = positions is not None
        if explicit_positions:
            positions = checked_positions(positions, batch, seq_len)
        real = None if attention_mask is None else checked_mask(attention_mask, batch, seq_len)
        if projections is not None:
            check_projections(projections, cfg, (cfg.num_layers, batch, seq_len),
                              "projections")
        if prefix_kv is not None:
            layout = after_prefix_layout(cfg, batch, seq_len, prefix_kv, positions, real)
        else:
            layout = cache_free_layout(cfg, batch, seq_len, positions, real)
        hidden, logits, values, (token_kv, produced) = self._forward(
            tokens, layout, stored=projections, return_kv=return_kv,
            return_projections=return_projections, compute_logits=compute_logits,
            constant_rope=prefix_kv is None and not explicit_positions and real is None)
        cache = None
        if return_kv:
            cache = KVCache(keys=token_kv[0], values=token_kv[1],
                            length=jnp.full((batch,), seq_len, jnp.int32))
        return ModelOutput(logits=logits, values=values, cache=cache,
                           hidden=hidden if return_hidden else None,
                           projections=produced if return_projections else None)

    def decode(self, tokens, cache: KVCache, *, num_valid=None, positions=None,
               attention_mask=None, compute_logits: bool = True, return_hidden: bool = False,
               return_projections: bool = False) -> ModelOutput:
        """Tokens int32 [B, T] run through the KV `cache` (stacked, or per layer:
        `KVCache.per_layer()`, with stacked or `per_layer_params` parameters): prefill of
        a prompt and decoding of sampled tokens alike.

        The T tokens are appended to row b at positions cache.length[b] + arange(T);
        queries attend causally to every cached position <= their own. Writes past the
        capacity are dropped (outputs for such queries are meaningless).
        new_cache.length = length + num_valid (int32 [B], default T). Tokens t >=
        num_valid[b] are not written at all (stronger than "written but not counted":
        the cache of a row with num_valid 0 is bit-for-bit unchanged); their outputs are
        meaningless and valid queries never see them. This lets one call prefill a
        padded chunk, and lets finished rows idle during decoding.

        attention_mask: optional int/bool [B, T], 1/True = real token (padding anywhere,
          as in `__call__`). Padding is not written at all: real token t of row b goes
          to slot cache.length[b] + (number of real tokens of row b before t), so the
          cache holds only real tokens, packed from slot 0, and later calls (e.g.
          `generate`) never see the padding; the default position of a token is its
          slot, i.e. positions continue from each row's own count of real tokens.
          new_cache.length = length + mask.sum(1). Exclusive with num_valid (which is
          the special case mask[b, t] = t < num_valid[b]).
        positions: optional int [B, T] RoPE positions of this call's tokens (later calls
          without them use slot indices again); causality stays by slot order.
        compute_logits, return_hidden, return_projections: as in `__call__`. A cache
          with `projections` buffers (`init_cache(..., record_projections=True)`) gets
          the layers' projection outputs written at the slots its keys and values are
          written to, whatever return_projections.

        Returns ModelOutput(logits f32 [B, T, V], values f32 [B, T] or None, the updated
        cache, hidden or None, projections or None).
        """
        cfg = self.config
        batch, seq_len = _checked_tokens(tokens)
        if not isinstance(cache, KVCache):
            raise ValueError(f"Transformer.decode: cache must be a KVCache (`init_cache`), "
                             f"got {type(cache).__name__}")
        if positions is not None:
            positions = checked_positions(positions, batch, seq_len)
        real = None if attention_mask is None else checked_mask(attention_mask, batch, seq_len)
        layout = cached_layout(cfg, batch, seq_len, cache, positions, real, num_valid)
        recording = cache.projections is not None
        if recording:
            check_projections(cache.projections, cfg,
                              (cfg.num_layers, batch, cache.capacity), "cache.projections")
        hidden, logits, values, (layer_caches, produced, recorded) = self._forward(
            tokens, layout, cache=cache, return_projections=return_projections,
            compute_logits=compute_logits)
        if recording and recorded is None:
            recorded = write_projections(cache.projections, layout.write_positions, produced)
        new_cache = KVCache(keys=layer_caches[0], values=layer_caches[1],
                            length=cache.length + layout.num_valid, projections=recorded)
        return ModelOutput(logits=logits, values=values, cache=new_cache,
                           hidden=hidden if return_hidden else None,
                           projections=produced if return_projections else None)

    @nn.compact
    def _forward(self, tokens, layout: CallLayout, *, cache: KVCache | None = None,
                 stored=None, return_kv=False, return_projections=False,
                 compute_logits=True, constant_rope=False):
        """Embedding, decoder layers, final norm and heads of both entry points, on the
        tokens placed by `layout` (and written to `cache`). Returns (hidden, logits or
        None, values or None, the layers' outputs: `_layers`')."""
        cfg = self.config
        embed = nn.Embed(
            cfg.vocab_size, cfg.d_model, dtype=cfg.dtype, param_dtype=cfg.param_dtype,
            embedding_init=nn.with_logical_partitioning(weight_init(cfg), ("vocab", "embed")),
            name="embed_tokens")
        # The lookup reads the table gathered over fsdp (as every FSDP weight is), so the
        # rows come out batch-sharded like the tokens, not split along d_model. (Loops of
        # forward passes gather it once beforehand: `gather_embedding`.)
        table = constrain_activation(embed.embedding, ("activation_vocab", "activation_embed"))
        h = constrain_activation(jnp.take(table.astype(cfg.dtype), tokens, axis=0), RESIDUAL)
        # Every layer rotates by the same angles. At the default positions 0..T-1 (no
        # cache, no mask: the training forward pass) they are constants of the program:
        # computed in it, XLA fused the cos and sin into each rotation and evaluated them
        # again for every head, in every layer, forward and backward.
        rope = None
        if constant_rope:
            rope = constant_rope_tables(tokens.shape[1], cfg.resolved_head_dim,
                                        cfg.rope_theta, cfg.dtype, cfg.rope_scaling)
        if rope is None:
            rope = rope_tables(layout.positions, cfg.resolved_head_dim, cfg.rope_theta,
                               cfg.dtype, cfg.rope_scaling)
        h, layers_out = self._layers(h, layout, rope, cache, stored, return_kv,
                                     return_projections)
        hidden = constrain_activation(
            RMSNorm(cfg.norm_eps, cfg.dtype, cfg.param_dtype, name="norm")(h), RESIDUAL)
        logits = self._logits(hidden, embed) if compute_logits else None
        values = None
        if cfg.value_head:
            values = nn.Dense(
                1, dtype=jnp.float32, param_dtype=cfg.param_dtype,
                kernel_init=nn.with_logical_partitioning(weight_init(cfg), ("embed", None)),
                bias_init=nn.with_logical_partitioning(nn.initializers.zeros, (None,)),
                name="value_head")(hidden.astype(jnp.float32))[..., 0]
        return hidden, logits, values, layers_out

    def _layers(self, h, layout: CallLayout, rope, cache, stored, return_kv,
                return_projections):
        """The decoder layers on the residual stream h [B, T, D]: a scan over the stacked
        layers, or (per-layer cache) the layers one by one (`run_per_layer`).

        Returns (h, layers' outputs): without a cache ((keys, values) of the T tokens
        with return_kv, else None; their projection outputs {name: [L, B, T, ...]} or
        None); with one (the cache's updated (keys, values); the projection outputs; the
        updated projection buffers if the per-layer path wrote them, else None).
        """
        cfg = self.config
        layer_args = (layout.positions, rope, layout.write_positions, layout.key_positions,
                      layout.attend, layout.key_mask, layout.slots)
        recording = cache is not None and cache.projections is not None
        if cache is not None and cache.is_per_layer:
            h, layer_caches, produced, recorded = run_per_layer(
                cfg, self.variables["params"]["layers"], h, layout.layer_caches, layer_args,
                return_projections,
                (cache.projections, layout.write_positions) if recording else None)
            return h, (layer_caches, produced, recorded)
        if isinstance(self.variables.get("params", {}).get("layers"), (tuple, list)):
            raise ValueError("Transformer: parameters with per-layer trees "
                             "(`per_layer_params`) need a per-layer cache "
                             "(`KVCache.per_layer()`); pass the stacked parameters")
        layer_cls = DecoderLayer
        if cfg.remat:
            layer_cls = nn.remat(layer_cls, prevent_cse=False)
        layers = nn.scan(
            layer_cls, variable_axes={"params": 0}, split_rngs={"params": True},
            in_axes=(0, 0, 0, nn.broadcast, nn.broadcast, nn.broadcast, nn.broadcast,
                     nn.broadcast, nn.broadcast, nn.broadcast),
            length=cfg.num_layers,
            # Cached calls keep one layer per iteration: their in-place update of the
            # stacked cache measured slower unrolled (docs/performance.md, "Attention
            # and the update"); a per-layer cache runs the layers one by one instead.
            unroll=min(cfg.layer_unroll, cfg.num_layers) if cache is None else 1,
            metadata_params={nn.PARTITION_NAME: "layers"})(
                cfg, return_kv=return_kv, return_projections=return_projections or recording,
                name="layers")
        (h, layer_caches), (token_kv, produced) = layers(
            (h, layout.layer_caches), jnp.arange(cfg.num_layers, dtype=jnp.int32),
            layout.prefix_layers, stored, *layer_args)
        if cache is None:
            return h, (token_kv, produced)
        return h, (layer_caches, produced, None)

    def _logits(self, hidden, embed: nn.Embed):
        """f32 [B, T, V] logits of the final-normed hidden states (the tied embedding
        table transposed, or `lm_head`)."""
        cfg = self.config
        batch, seq_len = hidden.shape[:2]
        if cfg.tie_embeddings:
            unembed = embed.embedding.T  # [D, V]
        else:
            unembed = self.param(
                "lm_head", nn.with_logical_partitioning(weight_init(cfg), ("embed", "vocab")),
                (cfg.d_model, cfg.vocab_size), cfg.param_dtype)
        # On the flattened tokens, like the layers' projections (no transposed copy of the
        # logits' gradient for the weight-gradient matmul).
        logits = jnp.einsum("nd,dv->nv", hidden.reshape(batch * seq_len, cfg.d_model),
                            unembed.astype(cfg.dtype),
                            preferred_element_type=jnp.float32).reshape(
                                batch, seq_len, cfg.vocab_size)
        return constrain_activation(mask_padded_vocab(logits, cfg), LOGITS)


def _checked_tokens(tokens) -> tuple[int, int]:
    """(B, T) of tokens, which must be an integer array [B, T]."""
    if tokens.ndim != 2:
        raise ValueError(f"Transformer: tokens must be [B, T], got shape {tokens.shape}")
    if not jnp.issubdtype(tokens.dtype, jnp.integer):
        raise ValueError(f"Transformer: tokens must be an integer array, got {tokens.dtype}")
    return tokens.shape


def gather_embedding(params, config: TransformerConfig):
    """`params` with the embedding table in the activation dtype, laid out as the forward
    pass reads it (gathered over fsdp; no operation without an activation mesh).

    For loops of forward passes over the same parameters (a rollout's turns and decoded
    tokens): the forward pass gathers the table itself, and inside nested loops XLA kept
    one gathered copy per loop level, in float32 on XLA:CPU (which runs bfloat16
    collectives in float32): six [V, D] float32 buffers at the peak of Qwen2.5-0.5B's
    rollout on 64 devices (docs/performance.md, "Attention and the update"). Gathered
    once before the loops, the forward pass's own constraint is a no-op and one copy is
    kept. The values are the forward pass's own (the same cast, earlier): outputs are
    unchanged.
    """
    params = dict(params)
    embed = dict(params["embed_tokens"])
    table = nn.unbox(embed["embedding"]).astype(config.dtype)
    embed["embedding"] = constrain_activation(table, ("activation_vocab", "activation_embed"))
    params["embed_tokens"] = embed
    return params


def unembedding_matrix(params, config: TransformerConfig) -> jax.Array:
    """The [d_model, vocab] output projection: logits = hidden @ W (f32 accumulation).

    With `return_hidden=True, compute_logits=False` this lets callers compute log-probs
    in chunks without materialising [B, T, V] logits. Accepts plain or boxed params.
    """
    matrix, vocab_major = output_matrix(params, config)
    return matrix.T if vocab_major else matrix


def output_matrix(params, config: TransformerConfig) -> tuple[jax.Array, bool]:
    """(matrix, vocab_major): the output projection as stored, for
    `arl.models.chunked_logprobs.chunked_token_logprobs`: the tied embedding table [V, D]
    (vocab_major True), or the untied `lm_head` [D, V] (False). Reading the tied table as
    stored spares the transposed copy `unembedding_matrix` makes of it. Accepts plain or
    boxed params."""
    params = nn.unbox(params)
    tokens = config.token_vocab_size or config.vocab_size  # padded ids are no targets
    if config.tie_embeddings:
        table = params["embed_tokens"]["embedding"]
        return (table if tokens == config.vocab_size else table[:tokens]), True
    head = params["lm_head"]
    return (head if tokens == config.vocab_size else head[:, :tokens]), False


def abstract_params(model: Transformer, batch_size: int = 1, seq_len: int = 1):
    """Boxed parameter shapes (`nn.LogicallyPartitioned` of ShapeDtypeStruct), no memory."""
    tokens = jax.ShapeDtypeStruct((batch_size, seq_len), jnp.int32)
    return jax.eval_shape(model.init, jax.random.key(0), tokens)["params"]
