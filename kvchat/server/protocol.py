"""The OpenAI chat-completions surface: request parsing and validation, response and error bodies.

Field names and error shapes follow the OpenAI API reference ("Create chat
completion", "Error codes"): errors are ``{"error": {"message", "type",
"param", "code"}}``; reused prompt tokens are ``usage.prompt_tokens_details.cached_tokens``.
kvchat adds a ``kvchat`` object per completion (where the prompt's K/V came from).
"""

from __future__ import annotations

import json
import math
import re
import time
from dataclasses import dataclass, field

from kvchat.engine.grammar import Grammar, GrammarError, json_schema_grammar
from kvchat.engine.token_rules import MAX_TOP_LOGPROBS, TokenLogprob
from kvchat.engine.turn import LIMITS, SamplingParams, TurnStats
from kvchat.server.tools import GENERIC, Tool, ToolCall, ToolStyle, call_grammar, calls_text, parse_calls, result_text
from kvchat.utf8 import NotUtf8Error, require_utf8

ROLES = ("system", "developer", "user", "assistant", "tool")
TOOL_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's rule for a function's name
MAX_STOP = 4  # stop sequences at most (as the OpenAI API)
MAX_CHOICES = 8  # n at most: the largest decode batch bucket, so a request's choices decode in one step
MAX_STOP_CHARS = 256  # characters per stop sequence at most: holding back a partial match costs O(length^2) a token
# the request's fields kvchat uses (README's server section says what each does)
# (``top_k`` is not OpenAI's: vLLM and llama.cpp's server take it, and clients written for them send it)
USED_FIELDS = ("model", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "seed",
               "stop", "stream", "stream_options", "n", "presence_penalty", "frequency_penalty", "response_format",
               "logprobs", "top_logprobs", "logit_bias", "modalities", "tools", "tool_choice", "parallel_tool_calls")
# OpenAI fields that leave the answer as it is: accepted and not used
NO_EFFECT_FIELDS = ("user", "metadata", "store", "service_tier", "prompt_cache_key", "safety_identifier")
# OpenAI fields that would change the answer and that kvchat does not implement: refused unless null or empty
REFUSED_FIELDS = ("functions", "function_call", "audio",
                  "prediction", "reasoning_effort", "verbosity", "web_search_options")


class ApiError(Exception):
    """A request the server refuses: HTTP ``status`` with an OpenAI-style error object.

    Attributes:
        status: HTTP status code (400, 401, 404, 413, 503, …).
        type: OpenAI error type (``invalid_request_error``, ``authentication_error``, …).
        param: the request field at fault, if any.
        code: a short machine-readable code, if any.
        headers: extra response headers (``Retry-After`` on 503).
    """

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers or {}

    def body(self) -> dict:
        """The JSON error object."""
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


@dataclass(slots=True)
class ChatRequest:
    """A validated ``POST /v1/chat/completions``.

    Attributes:
        model: the model name asked for.
        system: the leading system (or developer) messages, joined by blank lines ("" if none).
        turns: earlier ``(user, assistant)`` message pairs.
        user: the last user message (what this request asks).
        params: sampling; ``max_tokens`` None until the server caps it by the context.
        stop: strings that end the answer (not included in it).
        stream: answer as Server-Sent Events.
        include_usage: streaming: a last chunk with ``usage`` (``stream_options.include_usage``).
        grammar: what the answer must match (``response_format`` json_object / json_schema), or None.
        logit_bias: token id -> value added to its logit (ids not yet checked against the vocabulary).
        top_logprobs: ``logprobs: true``: alternatives per token (0–20); None: no log-probabilities.
        tools: the functions offered (their block is already at the end of ``system``).
        tool_choice: ``none``, ``auto``, ``required`` or ``function`` (``tool_name``); ``required`` and
            ``function`` have their call's grammar in ``grammar``.
        tool_name: the function ``tool_choice`` names.
        tool_style: how the model is told about tools and writes calls (the server's model's).
        template_kwargs: the chat template's variables for this chat (its tools where the template renders
            them itself: :meth:`kvchat.server.tools.ToolStyle.chat_kwargs`), stored with the chat.
        user_roles: the role each user-side message is rendered as (:meth:`ChatFormat.user_turn`'s), the
            earlier turns' then the last's: ``"user"``, or ``"tool"`` for tool results the template renders
            as a turn of their own (:attr:`kvchat.server.tools.ToolStyle.result_role`).
        n: choices to generate (:mod:`kvchat.server.choices`).
        parallel_tool_calls: an answer may hold several calls (``tool_choice: auto``); False: at most one, the
            answer ends after its first call. A forced call is always one.
    """

    model: str
    system: str
    turns: list[tuple[str, str]]
    user: str
    params: SamplingParams
    max_tokens: int | None
    stop: list[str] = field(default_factory=list)
    stream: bool = False
    include_usage: bool = False
    grammar: Grammar | None = None
    logit_bias: dict[int, float] = field(default_factory=dict)
    top_logprobs: int | None = None
    tools: list[Tool] = field(default_factory=list)
    tool_choice: str = "none"
    tool_name: str | None = None
    n: int = 1
    parallel_tool_calls: bool = True
    tool_style: ToolStyle = GENERIC
    template_kwargs: dict = field(default_factory=dict)
    user_roles: list[str] = field(default_factory=list)


def _bad(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, param=param, code=code)


def _text(content, where: str) -> str:
    """A message's content as UTF-8 text: a string, or a list of ``{"type": "text", "text": ...}`` parts."""
    text = _parts(content, where)
    try:
        return require_utf8(text, f"{where}.content")
    except NotUtf8Error as exc:
        raise _bad(str(exc), where) from None


def _parts(content, where: str) -> str:
    """A message's content, a string or a list of ``{"type": "text", "text": ...}`` parts, as one string."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                raise _bad(f"{where}.content: only text parts are supported", where)
            parts.append(part["text"])
        return "".join(parts)
    raise _bad(f"{where}.content must be a string or a list of text parts", where)


def _number(body: dict, name: str, lo: float, hi: float, default: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or not lo <= value <= hi:
        raise _bad(f"{name} must be a number in [{lo:g}, {hi:g}], got {value!r}", name)
    return float(value)


def _int(body: dict, name: str, lo: int, hi: int) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise _bad(f"{name} must be an integer in [{lo}, {hi}], got {value!r}", name)
    return value


def parse_chat_request(raw: bytes, tool_style: ToolStyle = GENERIC) -> ChatRequest:
    """Validate a request body (JSON bytes); ``tool_style``: the model's (:mod:`kvchat.server.template_tools`).

    Raises:
        ApiError: 400 for malformed or too deeply nested JSON, wrong types, out-of-range values, unsupported
            features (``n`` > :data:`MAX_CHOICES`, the fields of :data:`REFUSED_FIELDS`, unknown fields), a ``response_format``
            whose schema cannot be compiled, roles other than system/developer/user/assistant, a conversation that does not
            start and end with a user message). Consecutive messages of one role are joined (blank line).
    """
    try:
        body = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise _bad(f"the request body is not valid JSON: {exc}") from None
    except RecursionError:  # json's C parser recurses once per nesting level
        raise _bad("the request body is nested too deeply") from None
    if not isinstance(body, dict):
        raise _bad("the request body must be a JSON object")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise _bad("model is required (a string; see GET /v1/models)", "model")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise _bad("messages must be a non-empty list", "messages")
    _refuse_unknown(body)
    n = _int(body, "n", 1, MAX_CHOICES) or 1
    system, seq = [], []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise _bad(f"{where}.role must be one of {', '.join(ROLES)}", where)
        role = m["role"]
        if role == "assistant" and m.get("tool_calls"):
            text = _assistant_calls(m, where, tool_style)
        elif role == "tool":
            if not isinstance(m.get("tool_call_id"), str):
                raise _bad(f"{where}.tool_call_id is required (a string) in a tool message", where)
            text = _text(m.get("content"), where)
        else:
            text = _text(m.get("content"), where)
        if role in ("system", "developer"):
            if seq:
                raise _bad(f"{where}: system messages are supported only before the first user message", where)
            system.append(text)
        else:
            seq.append((role, text, where))
    seq = _join_runs(seq, tool_style)
    if seq and seq[0][0] != "user":
        raise _bad(f"{seq[0][2]}: the first message after the system prompt must be a user message", seq[0][2])
    if not seq or seq[-1][0] != "user":
        raise _bad("the last message must be a user message", "messages")
    if not seq[-1][1].strip():
        raise _bad("the last user message is empty", "messages")
    stop = body.get("stop")
    stop = [stop] if isinstance(stop, str) else stop if stop is not None else []
    if not isinstance(stop, list) or len(stop) > MAX_STOP or \
            not all(isinstance(s, str) and 0 < len(s) <= MAX_STOP_CHARS for s in stop):
        raise _bad(f"stop must be a string or a list of at most {MAX_STOP} non-empty strings of at most "
                   f"{MAX_STOP_CHARS} characters", "stop")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise _bad("stream must be a boolean", "stream")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise _bad("stream_options must be an object", "stream_options")
    if not isinstance(options.get("include_usage", False), bool):
        raise _bad("stream_options.include_usage must be a boolean", "stream_options")
    max_tokens = _int(body, "max_completion_tokens", 1, LIMITS.count)
    if max_tokens is None:
        max_tokens = _int(body, "max_tokens", 1, LIMITS.count)
    params = SamplingParams(temperature=_number(body, "temperature", 0, LIMITS.temperature, 1.0),
                            top_p=_number(body, "top_p", 0, 1, 1.0), top_k=_int(body, "top_k", 0, LIMITS.count) or 0,
                            seed=_int(body, "seed", 0, LIMITS.seed),
                            presence_penalty=_number(body, "presence_penalty", -LIMITS.penalty, LIMITS.penalty, 0.0),
                            frequency_penalty=_number(body, "frequency_penalty", -LIMITS.penalty, LIMITS.penalty, 0.0))
    if params.top_p == 0:
        raise _bad("top_p must be > 0", "top_p")
    texts = [t for _, t, _, _ in seq]
    tools = _tools(body.get("tools"))
    choice, name = _tool_choice(body.get("tool_choice"), tools)
    grammar = _response_format(body.get("response_format"))
    if choice in ("required", "function"):
        if grammar is not None:
            raise _bad("response_format cannot be combined with a tool_choice that forces a call", "response_format")
        grammar = _tool_grammar(tools, name, tool_style)
    parallel = body.get("parallel_tool_calls", True)
    if not isinstance(parallel, bool):
        raise _bad("parallel_tool_calls must be a boolean", "parallel_tool_calls")
    if tools:
        system = [tool_style.system(system, tools)]
    return ChatRequest(model, "\n\n".join(system), list(zip(texts[:-1:2], texts[1:-1:2])), texts[-1], params, max_tokens,
                       stop, stream, bool(options.get("include_usage")), grammar, _logit_bias(body.get("logit_bias")),
                       _top_logprobs(body), tools, choice, name, n, parallel, tool_style, tool_style.chat_kwargs(tools),
                       [r for kind, _, _, r in seq if kind == "user"])


def _assistant_calls(m: dict, where: str, style: ToolStyle) -> str:
    """An assistant message with ``tool_calls`` as the text the model writes
    (:func:`kvchat.server.tools.calls_text`: the text a generated call answer is stored as).

    Raises:
        ApiError: 400 for a call without a function name or with arguments that are not JSON object text, or
            several calls in one message where the model's template takes one (an untagged style's).
    """
    content = "" if m.get("content") is None else _text(m["content"], where)
    calls = m["tool_calls"]
    if not isinstance(calls, list):
        raise _bad(f"{where}.tool_calls must be a list", where)
    if len(calls) > 1 and not style.tagged:
        raise _bad(f"{where}.tool_calls: the model's chat template takes one call per assistant message", where)
    pairs = []
    for j, call in enumerate(calls):
        fn = call.get("function") if isinstance(call, dict) else None
        if not (isinstance(fn, dict) and isinstance(fn.get("name"), str) and isinstance(fn.get("arguments"), str)):
            raise _bad(f"{where}.tool_calls[{j}] must have function.name and function.arguments (strings)", where)
        try:
            arguments = json.loads(fn["arguments"])
        except json.JSONDecodeError:
            arguments = None
        if not isinstance(arguments, dict):
            raise _bad(f"{where}.tool_calls[{j}].function.arguments must be a JSON object's text", where)
        pairs.append((fn["name"], fn["arguments"]))
    return calls_text(content or None, pairs, style)


def _tools(value) -> list[Tool]:
    """``tools`` as :class:`Tool` objects (a function's ``parameters`` default to any object).

    Raises:
        ApiError: 400 (``param: tools``) for a malformed entry, a missing or invalid name, a name given twice,
            or ``parameters`` llguidance cannot enforce (the message names the keyword).
    """
    if value is None:
        return []
    if not isinstance(value, list):
        raise _bad("tools must be a list of {\"type\": \"function\", \"function\": {...}}", "tools")
    if not value:  # as the OpenAI API: leave the field out to offer none
        raise _bad("tools is an empty array; expected at least one tool (leave tools out to offer none)", "tools",
                   "empty_array")
    tools, seen = [], set()
    for i, entry in enumerate(value):
        fn = entry.get("function") if isinstance(entry, dict) and entry.get("type") == "function" else None
        if not isinstance(fn, dict):
            raise _bad(f"tools[{i}] must be {{\"type\": \"function\", \"function\": {{...}}}}", "tools")
        name = fn.get("name")
        if not (isinstance(name, str) and TOOL_NAME.fullmatch(name)):
            raise _bad(f"tools[{i}].function.name is required: 1 to 64 letters, digits, _ or -", "tools")
        if name in seen:
            raise _bad(f"tools[{i}]: the function {name!r} is defined twice", "tools")
        description = fn.get("description", "")
        parameters = fn.get("parameters", {"type": "object"})
        if not isinstance(description, str) or not isinstance(parameters, dict):
            raise _bad(f"tools[{i}].function: description must be a string and parameters an object", "tools")
        if parameters.get("type", "object") != "object":  # a call's arguments are a JSON object (OpenAI's rule)
            raise _bad(f"tools[{i}].function.parameters must be an object schema (\"type\": \"object\"), got "
                       f"\"type\": {json.dumps(parameters['type'])}", "tools", "invalid_json_schema")
        tool = Tool(name, description, parameters)
        try:
            call_grammar([tool])
        except GrammarError as exc:
            raise _bad(f"tools[{i}].function.parameters: {exc}", "tools", "invalid_json_schema") from None
        seen.add(name)
        tools.append(tool)
    return tools


def _tool_choice(value, tools: list[Tool]) -> tuple[str, str | None]:
    """``(none | auto | required | function, the named function)``; default ``auto`` with tools, ``none``
    without (as the OpenAI API).

    Raises:
        ApiError: 400 (``param: tool_choice``) for another value, a choice other than none without tools,
            or a function name not among ``tools``.
    """
    if value is None:
        return ("auto" if tools else "none"), None
    if value in ("none", "auto", "required"):
        if value != "none" and not tools:
            raise _bad(f"tool_choice {value!r} needs tools", "tool_choice")
        return value, None
    fn = value.get("function") if isinstance(value, dict) and value.get("type") == "function" else None
    if not (isinstance(fn, dict) and isinstance(fn.get("name"), str)):
        raise _bad("tool_choice must be none, auto, required or {\"type\": \"function\", \"function\": "
                   "{\"name\": ...}}", "tool_choice")
    if fn["name"] not in {t.name for t in tools}:
        raise _bad(f"tool_choice names the function {fn['name']!r}, which is not in tools", "tool_choice")
    return "function", fn["name"]


def _tool_grammar(tools: list[Tool], name: str | None, style: ToolStyle) -> Grammar:
    try:
        return call_grammar(tools, name, style)
    except GrammarError as exc:  # each function's parameters compiled alone; together they may still not
        raise _bad(f"tools: {exc}", "tools", "invalid_json_schema") from None


def _response_format(fmt) -> Grammar | None:
    """The grammar of ``response_format``: None for ``text``, any JSON object for ``json_object``, the
    schema's documents for ``json_schema`` (enforced whether ``strict`` is true or not).

    Raises:
        ApiError: 400 for another type, a malformed ``json_schema`` object, or a schema llguidance cannot
            compile (the message names the keyword).
    """
    if fmt is None:
        return None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return json_schema_grammar({"type": "object"}, "response_format")
    if kind != "json_schema":
        raise _bad(f"response_format.type must be text, json_object or json_schema, got {kind!r}", "response_format")
    spec = fmt.get("json_schema")
    if not isinstance(spec, dict) or not isinstance(spec.get("name"), str) or not spec["name"]:
        raise _bad("response_format.json_schema must be an object with a name", "response_format")
    if not isinstance(spec.get("strict", False), (bool, type(None))):
        raise _bad("response_format.json_schema.strict must be a boolean", "response_format")
    schema = spec.get("schema", {"type": "object"})
    try:
        return json_schema_grammar(schema, "response_format.json_schema.schema")
    except GrammarError as exc:
        raise _bad(f"invalid JSON schema: {exc}", "response_format", "invalid_json_schema") from None


def _logit_bias(bias) -> dict[int, float]:
    """``logit_bias`` as ``{token id: value}`` (OpenAI's keys are token ids as strings; values in [-100, 100]).

    Raises:
        ApiError: 400 for a key that is not a non-negative integer or a value out of range.
    """
    if bias is None:
        return {}
    if not isinstance(bias, dict):
        raise _bad("logit_bias must be an object mapping token ids to numbers in [-100, 100]", "logit_bias")
    out = {}
    for key, value in bias.items():
        if not (isinstance(key, str) and key.isascii() and key.isdigit()):
            raise _bad(f"logit_bias: {key!r} is not a token id", "logit_bias")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not -100 <= value <= 100:
            raise _bad(f"logit_bias[{key!r}] must be a number in [-100, 100], got {value!r}", "logit_bias")
        out[int(key)] = float(value)
    return out


def _top_logprobs(body: dict) -> int | None:
    """Alternatives per token when ``logprobs`` is true (``top_logprobs``, default 0); None otherwise.

    Raises:
        ApiError: 400 when ``logprobs`` is not a boolean, ``top_logprobs`` is out of [0, 20] or set without
            ``logprobs: true`` (as the OpenAI API).
    """
    wanted = body.get("logprobs")
    if wanted is not None and not isinstance(wanted, bool):
        raise _bad("logprobs must be a boolean", "logprobs")
    top = _int(body, "top_logprobs", 0, MAX_TOP_LOGPROBS)
    if top is not None and not wanted:
        raise _bad("top_logprobs needs logprobs: true", "top_logprobs")
    return (top or 0) if wanted else None


def _refuse_unknown(body: dict) -> None:
    """Refuse (400) a field kvchat does not implement that would change the answer: a field of
    :data:`REFUSED_FIELDS` that is set, or a field that is none of the known ones."""
    for name in REFUSED_FIELDS:
        if body.get(name):
            raise _bad(f"{name} is not supported by kvchat serve", name)
    if body.get("modalities") not in (None, [], ["text"]):
        raise _bad(f"modalities {body['modalities']!r} is not supported by kvchat serve (only [\"text\"])", "modalities")
    unknown = sorted(set(body) - {*USED_FIELDS, *NO_EFFECT_FIELDS, *REFUSED_FIELDS})
    if unknown:
        raise _bad(f"unknown field {unknown[0]!r} (kvchat serve accepts {', '.join(USED_FIELDS + NO_EFFECT_FIELDS)})",
                   unknown[0])


def _join_runs(seq: list[tuple[str, str, str]], style: ToolStyle) -> list[tuple[str, str, str, str]]:
    """``(role, text, where)`` messages (user, tool or assistant) as ``(user | assistant, text, where, the role
    it renders as)``: each run of user-side messages (user and tool) or of assistant messages joined into
    its first message, texts separated by a blank line (as OpenAI-compatible servers accept consecutive user
    messages). A run of tool results only renders as the template's tool turn where ``style`` has one
    (``result_role: tool``); otherwise each tool result in it is :func:`result_text` in a user turn."""
    runs: list[tuple[str, list[tuple[str, str]], str]] = []
    for role, text, where in seq:
        kind = "assistant" if role == "assistant" else "user"
        if runs and runs[-1][0] == kind:
            runs[-1][1].append((role, text))
        else:
            runs.append((kind, [(role, text)], where))
    out = []
    for kind, parts, where in runs:
        own = style.result_role == "tool" and all(role == "tool" for role, _ in parts)
        texts = [result_text(text) if role == "tool" and not own else text for role, text in parts]
        out.append((kind, "\n\n".join(texts), where, "tool" if own else "user"))
    return out


def kvchat_block(stats: TurnStats, ttft_ms: float, miss_reason: str | None, chat_id: str | None) -> dict:
    """The ``kvchat`` object of a completion: where the prompt's K/V came from, and the chat it is stored in."""
    return {**stats.to_json(("from_memory", "from_disk", "prefilled_tokens", "restore_ms")),
            "ttft_ms": round(ttft_ms, 2), "miss_reason": miss_reason, "chat_id": chat_id}


def usage_block(stats: TurnStats) -> dict:
    """OpenAI ``usage`` with ``prompt_tokens_details.cached_tokens`` = tokens whose K/V were reused."""
    return {"prompt_tokens": stats.prompt_tokens, "completion_tokens": stats.new_tokens,
            "total_tokens": stats.prompt_tokens + stats.new_tokens,
            "prompt_tokens_details": {"cached_tokens": stats.reused_tokens}}


def logprobs_block(entries: list[TokenLogprob], token_bytes) -> dict:
    """A choice's ``logprobs`` in OpenAI's shape: ``{"content": [{token, logprob, bytes, top_logprobs}],
    "refusal": None}``. ``token_bytes(id)``: the bytes a token stands for (a token holding part of a UTF-8
    character shows it as U+FFFD in ``token``; ``bytes`` are exact)."""
    def item(token_id: int, logprob: float) -> dict:
        raw = token_bytes(token_id)
        return {"token": raw.decode("utf-8", errors="replace"), "logprob": logprob, "bytes": list(raw)}

    return {"content": [{**item(e.token_id, e.logprob), "top_logprobs": [item(i, lp) for i, lp in e.top]}
                        for e in entries], "refusal": None}


def answer_calls(req: ChatRequest, text: str, finish: str) -> tuple[str | None, list[ToolCall]] | None:
    """The calls of an answer (:func:`kvchat.server.tools.parse_calls`) when it is calls: tools offered
    (``tool_choice`` not ``none``), and the answer ended by itself; None otherwise."""
    if req.tools and req.tool_choice != "none" and finish == "stop":
        return parse_calls(text, req.tools, req.tool_style)
    return None


def stored_answer_text(req: ChatRequest, text: str, finish: str) -> str:
    """The text an answer is stored as: an answer of calls (:func:`answer_calls`) as
    :func:`kvchat.server.tools.calls_text` renders them, which is what a client resending the calls
    (:func:`answer_message`'s) renders, whatever spacing the model wrote around them; any other answer as
    it is."""
    parsed = answer_calls(req, text, finish)
    if parsed is None:
        return text
    content, calls = parsed
    return calls_text(content, [(c.name, c.arguments) for c in calls], req.tool_style)


def answer_message(req: ChatRequest, text: str, finish: str) -> tuple[dict, str]:
    """The assistant ``message`` and ``finish_reason`` of an answer: an answer of calls (:func:`answer_calls`)
    is ``{"content": text before the calls or None, "tool_calls": [...]}`` with ``finish_reason: tool_calls``;
    any other answer is its text."""
    parsed = answer_calls(req, text, finish)
    if parsed is None:
        return {"role": "assistant", "content": text}, finish
    content, calls = parsed
    return {"role": "assistant", "content": content, "tool_calls": [c.body() for c in calls]}, "tool_calls"


def joined_logprobs(blocks: list[dict | None]) -> dict | None:
    """One ``logprobs`` object from a stream's pieces (:func:`logprobs_block` each; the last is None when the
    request did not ask for them)."""
    if blocks[-1] is None:
        return None
    return {"content": [entry for block in blocks for entry in block["content"]], "refusal": None}


def completion_body(cid: str, model: str, choices: list[dict], usage: dict, kvchat: dict) -> dict:
    """A non-streaming ``chat.completion`` object (``choices``: each ``{index, message, logprobs,
    finish_reason}``, ``message`` :func:`answer_message`'s, ``logprobs`` :func:`logprobs_block` or None)."""
    return {"id": cid, "object": "chat.completion", "created": int(time.time()), "model": model,
            "choices": choices, "usage": usage, "kvchat": kvchat}


def held_deltas(req: ChatRequest, text: str, finish: str) -> tuple[list[dict], str]:
    """A held-back answer (``tool_choice: auto``: only its end says whether it is calls) as the stream deltas
    that carry it, and its ``finish_reason``: the text before the calls as ``content`` (if any), then each
    call as OpenAI streams one (:meth:`kvchat.server.tools.ToolCall.deltas`); or the whole text as
    ``content``."""
    parsed = answer_calls(req, text, finish)
    if parsed is None:
        return [{"content": text}], finish
    content, calls = parsed
    head = [] if content is None else [{"content": content}]
    return head + [d for i, call in enumerate(calls) for d in call.deltas(i)], "tool_calls"


def chunk_body(cid: str, model: str, delta: dict, finish: str | None = None, usage: dict | None = None,
               kvchat: dict | None = None, logprobs: dict | None = None, index: int = 0) -> dict:
    """One ``chat.completion.chunk`` of a stream (``choices`` empty on the usage-only last chunk;
    ``logprobs``: the delta's tokens, :func:`logprobs_block`; ``index``: the choice, with ``n`` > 1)."""
    choice = {"index": index, "delta": delta, "finish_reason": finish}
    if logprobs is not None:
        choice["logprobs"] = logprobs
    body = {"id": cid, "object": "chat.completion.chunk", "created": int(time.time()), "model": model,
            "choices": [] if delta is None else [choice]}
    if usage is not None:
        body["usage"] = usage
    if kvchat is not None:
        body["kvchat"] = kvchat
    return body


def sse_line(obj: dict) -> str:
    """One Server-Sent Event carrying ``obj`` as JSON."""
    return f"data: {json.dumps(obj)}\n\n"
