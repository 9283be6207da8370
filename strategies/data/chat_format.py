"""A conversation as the text the model reads: the processor's chat template, else weft's layout.

A model is served with its own chat template (transformers' ``apply_chat_template``, vLLM,
SGLang all render it), so training renders the same text. A processor that has one renders
every conversation with it; each image and video becomes the placeholder the template writes
(``<|vision_start|><|image_pad|><|vision_end|>`` for the Qwen-VL families), which
strategies/data/conversation.py widens to the image's feature count after tokenizing.

A processor without a template gets weft's built-in layout, which is Qwen2.5-VL's template
written out (without ``add_vision_id``)::

    <|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n     (when no system message)
    <|im_start|>{role}\\n{content}<|im_end|>\\n                         (each message)
    <|im_start|>assistant\\n                                           (the generation prompt)

Which characters carry labels is found by rendering prefixes: the reply of assistant message
``i`` is what ``messages[: i + 1]`` renders past ``messages[:i]`` with the generation prompt,
less the whitespace after its closing token (``<|im_end|>``): the model learns the reply and
to stop, not the newline that follows a turn. That works for any template that renders a
conversation's turns in order without looking ahead; one that does not (say, one that drops
the reasoning of earlier turns) is refused with a reason rather than labelled wrongly.

``system`` (the recipe's ``data.system``) is the system message of a conversation that does
not open with one, in place of the template's own default.
"""

from __future__ import annotations

import json
import pathlib
from collections.abc import Mapping, Sequence
from typing import Any, Callable

import attrs

DEFAULT_SYSTEM = "You are a helpful assistant."
IMAGE_PLACEHOLDER = "<|vision_start|><|image_pad|><|vision_end|>"
VIDEO_PLACEHOLDER = "<|vision_start|><|video_pad|><|vision_end|>"

Render = Callable[[list[dict], bool], str]  # (messages, add_generation_prompt) -> text


@attrs.frozen(kw_only=True)
class Rendered:
    text: str
    trained: tuple[tuple[int, int], ...]  # [start, end) character spans that carry labels


def render_chat(messages: Sequence[Mapping[str, Any]], *, tokenizer: Any, system: str | None = None,
                generation_prompt: bool = False) -> Rendered:
    """The conversation's text and its assistant replies' character spans.

    With ``generation_prompt`` the text ends with the header the model continues from (for
    ``weft generate``), and nothing is trained.
    """
    chat = template_messages(messages, system=system)
    render = renderer(tokenizer)
    text = render(chat, generation_prompt)
    if generation_prompt:
        return Rendered(text=text, trained=())
    spans = []
    for index, message in enumerate(chat):
        if message["role"] != "assistant":
            continue
        if index == 0:
            raise ValueError("the conversation opens with an assistant turn, which no prompt precedes: open it with "
                             "a user or system message (or set data.system)")
        before, through = render(chat[:index], True), render(chat[: index + 1], False)
        if not (through.startswith(before) and text.startswith(through)):
            raise ValueError(f"the chat template does not render message {index} (assistant) as a continuation of "
                             "the turns before it, so its reply cannot be told apart; weft labels replies by "
                             "rendering prefixes of the conversation")
        end = len(through.rstrip())
        if end > len(before):
            spans.append((len(before), end))
    return Rendered(text=text, trained=tuple(spans))


def template_messages(messages: Sequence[Mapping[str, Any]], *, system: str | None) -> list[dict]:
    """The messages as a template reads them: text as is, each image or video as a bare
    ``{"type": ...}`` part (templates test the type; the pixels stay out of rendering), and
    ``system`` first when given and the conversation has no system message. Content of text
    parts only is one string, as text-only models' templates (Llama's, SmolLM2's) concatenate
    it; vision templates render a string as they render its text parts, one after another."""
    chat = []
    for message in messages:
        content = message["content"]
        if not isinstance(content, str):
            content = [_bare(part) for part in content]
            if all(part["type"] == "text" for part in content):
                content = "".join(part["text"] for part in content)
        chat.append({"role": message["role"], "content": content})
    if system is not None and (not chat or chat[0]["role"] != "system"):
        chat.insert(0, {"role": "system", "content": system})
    return chat


def _bare(part: Mapping[str, Any]) -> dict:
    kind = part.get("type")
    if kind == "text":
        return {"type": "text", "text": part["text"]}
    if kind in ("image", "video"):
        return {"type": kind}
    raise ValueError(f"unsupported content type {kind!r} (text, image and video only)")


def renderer(tokenizer: Any) -> Render:
    """The tokenizer's chat template as a function, or weft's layout when it has none."""
    template = getattr(tokenizer, "chat_template", None)
    if not template:
        return builtin_layout
    if isinstance(template, dict):  # several named templates: transformers' default is "default"
        template = template.get("default") or next(iter(template.values()))

    def render(chat: list[dict], generation_prompt: bool) -> str:
        try:
            return tokenizer.apply_chat_template(chat, chat_template=template, tokenize=False,
                                                 add_generation_prompt=generation_prompt)
        except Exception as error:  # jinja's TemplateError, or a template's raise_exception()
            raise ValueError(f"the chat template failed: {type(error).__name__}: {error}") from error

    return render


def builtin_layout(chat: list[dict], generation_prompt: bool) -> str:
    """Qwen2.5-VL's chat template, written out for processors that have none."""
    out = []
    if chat and chat[0]["role"] != "system":  # as the template: the default opens a conversation
        out.append(f"<|im_start|>system\n{DEFAULT_SYSTEM}<|im_end|>\n")
    for message in chat:
        content = message["content"]
        if not isinstance(content, str):
            content = "".join(part["text"] if part["type"] == "text" else
                              IMAGE_PLACEHOLDER if part["type"] == "image" else VIDEO_PLACEHOLDER
                              for part in content)
        out.append(f"<|im_start|>{message['role']}\n{content}<|im_end|>\n")
    if generation_prompt:
        out.append("<|im_start|>assistant\n")
    return "".join(out)


def processor_chat_template(folder: pathlib.Path) -> str | None:
    """The chat template a model folder's processor carries, as AutoProcessor reads it:
    ``chat_template.jinja``, else the older ``chat_template.json``; None when it has neither
    (then the tokenizer's own, from tokenizer_config.json, if any). The processor's comes
    first because that is the one transformers' processor and vLLM render with."""
    jinja, legacy = folder / "chat_template.jinja", folder / "chat_template.json"
    if jinja.is_file():
        return jinja.read_text(encoding="utf-8")
    if not legacy.is_file():
        return None
    try:
        template = json.loads(legacy.read_text(encoding="utf-8"))["chat_template"]
    except (ValueError, KeyError, TypeError) as error:
        raise ValueError(f"{legacy}: not a chat template file ({type(error).__name__}: {error})") from error
    if not isinstance(template, str):
        raise ValueError(f"{legacy}: 'chat_template' is not a string")
    return template
