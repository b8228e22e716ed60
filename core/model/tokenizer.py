"""Tokenizer: a `tokenizers` tokenizer plus the model's chat template and end-of-sequence ids.

Two sources:
- a Hugging Face directory: ``tokenizer.json`` (+ optional ``tokenizer_config.json`` for the chat
  template and special tokens, ``generation_config.json`` / ``config.json`` for eos ids);
- GGUF tokenizer metadata of a byte-level BPE (``tokenizer.ggml.model == "gpt2"``): tokens,
  merges, token types, and the pre-tokenizer named by ``tokenizer.ggml.pre``. For SmolLM2
  (``pre == "smollm"``) this reproduces the Hugging Face tokenizer: digits split one by one, then
  GPT-2 byte-level splitting, no BOS added.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

from polyspec.errors import ModelLoadError

# llama.cpp pre-tokenizer names -> split regex (used before a regex-free ByteLevel step).
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_SPLITS = {"llama3": _LLAMA3_SPLIT, "llama-bpe": _LLAMA3_SPLIT, "llama-v3": _LLAMA3_SPLIT,
           "smaug-bpe": _LLAMA3_SPLIT, "qwen2": _QWEN2_SPLIT, "deepseek-r1-qwen": _QWEN2_SPLIT}  # fmt: skip
# llama.cpp pre-tokenizers that isolate every digit before GPT-2's regex.
_DIGIT_SPLIT = {"smollm", "starcoder", "refact", "codeshell", "command-r", "exaone", "minerva"}

Message = Mapping[str, Any]


def _token_str(value: Any) -> str | None:
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


def _ids(value: Any) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, (list, tuple)) else [int(value)]


class Tokenizer:
    """Text <-> token ids, chat-template rendering, and the model's end-of-sequence ids."""

    def __init__(
        self,
        tokenizer: Any,  # tokenizers.Tokenizer
        chat_template: str | None = None,
        bos_token: str | None = None,
        eos_token: str | None = None,
        eos_token_ids: Sequence[int] = (),
    ) -> None:
        self._tok = tokenizer
        self.chat_template = chat_template
        self._template: tuple[str, Any] | None = None  # (chat_template, compiled), first use
        self.bos_token = bos_token
        self.eos_token = eos_token
        ids = list(eos_token_ids)
        if eos_token is not None and (i := tokenizer.token_to_id(eos_token)) is not None:
            ids.append(i)
        self.eos_token_ids: tuple[int, ...] = tuple(dict.fromkeys(ids))
        self.bos_token_id: int | None = tokenizer.token_to_id(bos_token) if bos_token else None

    # ----------------------------------------------------------------------------- builders

    @classmethod
    def from_dir(cls, root: str | Path) -> Tokenizer:
        """From a Hugging Face directory holding ``tokenizer.json``."""
        from tokenizers import Tokenizer as HFTokenizer

        root = Path(root)
        path = root / "tokenizer.json"
        if not path.is_file():
            raise ModelLoadError(f"{root} has no tokenizer.json (needed to tokenize prompts)")
        try:
            tok = HFTokenizer.from_file(str(path))
        except Exception as e:
            raise ModelLoadError(f"cannot parse {path}: {e}") from None
        cfg = _read_optional_json(root / "tokenizer_config.json")
        template = cfg.get("chat_template")
        if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default") or next(iter(named.values()), None)
        if template is None and (root / "chat_template.jinja").is_file():
            template = (root / "chat_template.jinja").read_text(encoding="utf-8")
        eos_ids = _ids(_read_optional_json(root / "generation_config.json").get("eos_token_id"))
        eos_ids += _ids(_read_optional_json(root / "config.json").get("eos_token_id"))
        return cls(
            tok,
            chat_template=template,
            bos_token=_token_str(cfg.get("bos_token")),
            eos_token=_token_str(cfg.get("eos_token")),
            eos_token_ids=eos_ids,
        )

    @classmethod
    def from_gguf_metadata(cls, meta: Mapping[str, Any]) -> Tokenizer:
        """From GGUF ``tokenizer.*`` metadata of a byte-level BPE (``tokenizer.ggml.model`` gpt2)."""
        from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
        from tokenizers import Tokenizer as HFTokenizer

        kind = meta.get("tokenizer.ggml.model")
        if kind != "gpt2":
            raise ModelLoadError(
                f"GGUF tokenizer model {kind!r} is not supported (only byte-level BPE, 'gpt2'); "
                "pass a Hugging Face tokenizer directory instead"
            )
        tokens = list(meta.get("tokenizer.ggml.tokens") or ())
        merges = meta.get("tokenizer.ggml.merges")
        if not tokens or merges is None:
            raise ModelLoadError(
                "GGUF metadata lacks tokenizer.ggml.tokens or tokenizer.ggml.merges"
            )
        vocab = {t: i for i, t in enumerate(tokens)}
        bpe = models.BPE(
            vocab=vocab, merges=[tuple(m.split(" ", 1)) for m in merges], fuse_unk=False
        )
        tok = HFTokenizer(bpe)
        pre = meta.get("tokenizer.ggml.pre")
        if pre in _DIGIT_SPLIT:
            tok.pre_tokenizer = pre_tokenizers.Sequence(
                [
                    pre_tokenizers.Digits(individual_digits=True),
                    pre_tokenizers.ByteLevel(add_prefix_space=False),
                ]
            )
        elif pre in _SPLITS:
            tok.pre_tokenizer = pre_tokenizers.Sequence(
                [
                    pre_tokenizers.Split(Regex(_SPLITS[pre]), behavior="isolated"),
                    pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
                ]
            )
        else:  # "gpt2", "default" and unknown names: GPT-2's own regex
            tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        types = list(meta.get("tokenizer.ggml.token_type") or ())
        # 3 = CONTROL (special, never split), 4 = USER_DEFINED (matched whole, not special).
        control = [
            AddedToken(t, normalized=False, special=True) for t, ty in zip(tokens, types) if ty == 3
        ]
        user = [
            AddedToken(t, normalized=False, special=False)
            for t, ty in zip(tokens, types)
            if ty == 4
        ]
        if control:
            tok.add_special_tokens(control)
        if user:
            tok.add_tokens(user)

        def name(key: str) -> str | None:
            i = meta.get(key)
            return tokens[int(i)] if i is not None and 0 <= int(i) < len(tokens) else None

        eos_ids = _ids(meta.get("tokenizer.ggml.eos_token_id"))
        eos_ids += _ids(meta.get("tokenizer.ggml.eot_token_id"))
        template = meta.get("tokenizer.chat_template")
        # ChatML templates end an assistant turn with <|im_end|>; some GGUF exports (SmolLM2)
        # name another token as eos, so the turn terminator is added to the stop set too.
        if template and "<|im_end|>" in template and "<|im_end|>" in vocab:
            eos_ids.append(vocab["<|im_end|>"])
        return cls(
            tok,
            chat_template=template,
            bos_token=name("tokenizer.ggml.bos_token_id"),
            eos_token=None,
            eos_token_ids=eos_ids,
        )

    # ----------------------------------------------------------------------------- use

    @property
    def vocab_size(self) -> int:
        """Number of ids the tokenizer can produce (added tokens included)."""
        return int(self._tok.get_vocab_size(with_added_tokens=True))

    def to_json(self) -> str:
        """The ``tokenizers`` tokenizer as its tokenizer.json text (what a grammar engine
        reads the vocabulary from)."""
        return self._tok.to_str()

    def token_to_id(self, token: str) -> int | None:
        """Id of a token string, or None."""
        return self._tok.token_to_id(token)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; ``add_special_tokens`` applies the tokenizer's post-processor
        (e.g. a BOS) as Hugging Face does."""
        return list(self._tok.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of ``ids`` (special tokens dropped unless ``skip_special_tokens=False``)."""
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self,
        messages: str | Sequence[Message],
        add_generation_prompt: bool = True,
        tokenize: bool = False,
    ) -> str | list[int]:
        """Render the model's jinja chat template over ``messages`` (a list of
        ``{"role", "content"}`` dicts, or one user prompt string). With ``tokenize=True``
        the rendered text is encoded without adding special tokens (the template has them)."""
        if isinstance(messages, str):
            messages = [{"role": "user", "content": messages}]
        if not self.chat_template:
            raise ModelLoadError(
                "this tokenizer has no chat template (tokenizer_config.json chat_template or GGUF "
                "tokenizer.chat_template); pass raw text to encode() instead"
            )
        if self._template is None or self._template[0] != self.chat_template:
            # compiled once (compiling costs milliseconds a request), again if it is replaced
            self._template = (self.chat_template, _compile(self.chat_template))
        text = _render(
            self._template[1],
            messages=list(messages),
            add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token or "",
            eos_token=self.eos_token or "",
        )
        return self.encode(text, add_special_tokens=False) if tokenize else text


def _read_optional_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"cannot parse {path}: {e}") from None
    return data if isinstance(data, dict) else {}


def _compile(template: str) -> Any:
    """The chat template compiled in a sandbox, with the helpers HF templates expect."""
    import jinja2
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
    )
    env.filters["tojson"] = lambda x, indent=None, **_: json.dumps(
        x, ensure_ascii=False, indent=indent
    )
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(template)
    except jinja2.exceptions.TemplateError as e:
        raise ModelLoadError(f"the chat template does not compile: {e}") from None


def _render(template: Any, **context: Any) -> str:
    """Render a compiled chat template (:func:`_compile`)."""
    import jinja2

    try:
        return template.render(**context)
    except jinja2.exceptions.TemplateError as e:
        raise ModelLoadError(f"the chat template failed to render: {e}") from None
