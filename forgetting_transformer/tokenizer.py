"""The tokenizer of the authors' checkpoints (``import forgetting_transformer.tokenizer``).

Their models were trained on LongCrawl64, whose text went through the GPT-2 tokenizer as JSON
string literals (newlines as ``\\n``, quotes as ``\\"``, ...). ``JSONGPT2Tokenizer`` does the same:
it escapes text as JSON before the GPT-2 BPE and unescapes decoded text. Importing this module
registers it with ``AutoTokenizer`` under that name, which the checkpoints' tokenizer_config.json
names. Needs the ``hf`` extra.
"""
import json

try:
    from transformers import AutoTokenizer, GPT2Tokenizer, PretrainedConfig
except ImportError as e:  # pragma: no cover - exercised only without the extra
    raise ImportError("forgetting_transformer.tokenizer needs transformers: "
                      "pip install 'forgetting_transformer[hf]'") from e

__all__ = ["JSONGPT2Tokenizer"]


def _escape(text):
    """A string (or list of strings) as the inside of a JSON string literal."""
    if isinstance(text, str):
        return json.dumps(text)[1:-1]
    if isinstance(text, (list, tuple)) and all(isinstance(t, str) for t in text):
        return [json.dumps(t)[1:-1] for t in text]
    return text


def _unescape(text: str) -> str:
    try:
        return json.loads(f'"{text}"')
    except json.JSONDecodeError:  # an escape cut in half (e.g. a partial decode): best effort
        return text.encode().decode("unicode_escape", "ignore")


class JSONGPT2Tokenizer(GPT2Tokenizer):
    """GPT-2's tokenizer on JSON-escaped text (the LongCrawl64 convention)."""

    def _encode_plus(self, text, text_pair=None, *args, is_split_into_words: bool = False,
                     **kwargs):
        if not is_split_into_words:
            text, text_pair = _escape(text), _escape(text_pair)
        return super()._encode_plus(text, text_pair, *args,
                                    is_split_into_words=is_split_into_words, **kwargs)

    def _decode(self, token_ids, skip_special_tokens: bool = False,
                clean_up_tokenization_spaces=None, **kwargs) -> str:
        text = super()._decode(token_ids, skip_special_tokens=skip_special_tokens,
                               clean_up_tokenization_spaces=clean_up_tokenization_spaces, **kwargs)
        return _unescape(text)


class _TokenizerOnlyConfig(PretrainedConfig):
    """Only a key for AutoTokenizer.register (the checkpoints name the tokenizer class)."""

    model_type = "forgetting_transformer_json_gpt2_tokenizer"

    def __init__(self, **kwargs):
        super().__init__(**kwargs)


AutoTokenizer.register(_TokenizerOnlyConfig, JSONGPT2Tokenizer, exist_ok=True)
