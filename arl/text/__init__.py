"""Text machinery shared by environments and datasets: token ids <-> text and the pieces
that read and write token ids inside `jit`.

* `codec`: the `Codec` interface and `CharCodec` (one token per character).
* `hf_codec`: `HFCodec` over a Hugging Face `tokenizer.json` (and its chat template),
  `train_bpe_tokenizer`.
* `chat_template`: a model's Jinja chat template rendered and reduced to the fixed turn
  markers a token environment emits (`ChatFormat`).
* `tool_calls`: the template's tool convention (the `tools` list, calls in the model's
  format, results as `tool` messages) as static pieces (`derive_tool_chat_format`);
  several calls in one turn where the template renders them (`ToolCallSyntax`).
* `tool_schemas`: tools as users declare them (OpenAI function schemas, from a Python
  function's signature and docstring) and the check of a call's arguments.
* `seams`: an env's text and the template's text next to it tokenized as one text (the
  pieces cut at special tokens, `framed` / `encode_between`; numbers beside fixed texts
  inside `jit`, `NumberInText`).
* `chunks`: `TokenChunk` (a padded chunk of token ids, what token environments observe and
  act with) and building chunks inside `jit`.
* `parsing`: reading an agent's token ids inside `jit` (find, compare, parse integers).
* `verifiers`: checking an answer's characters against a reference inside `jit` (numeric,
  exact, normalized), each with a plain-Python reference.

Nothing here imports another `arl` package.
"""

from arl.text.chunks import TokenChunk
from arl.text.codec import CharCodec, Codec

__all__ = ["CharCodec", "Codec", "TokenChunk"]
