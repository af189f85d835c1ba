"""Tools in the model's own chat template, on the real SmolLM2 runtime in-process with its tokenizer's
template swapped (as tests/server/test_prefix.py does) for one in tests/data/templates: Qwen3's (Hermes-style
tools in the system message, ``<tool_call>`` calls with Qwen's spacing) and Llama 3.2's (with
``tools_in_user_message=False`` the tools in the system message, a call one bare JSON object, with
``parameters``; its header tokens take the place of five of SmolLM2's unused special tokens, so the model's
vocabulary holds them). SmolLM2's own template, which has no tools, gets the generic format."""

from __future__ import annotations

import dataclasses
import json
import queue
import shutil
from pathlib import Path

import jsonschema
import pytest
from transformers import AutoTokenizer

from kvchat.conversation.history_match import generated_answer
from kvchat.conversation.records import new_settings
from kvchat.runtime import load_runtime
from kvchat.server.prefix import render
from kvchat.server.protocol import answer_message, parse_chat_request
from kvchat.server.scheduler import Job, Scheduler
from kvchat.server.template_tools import follows, template_tool_style
from kvchat.server.tools import GENERIC, LLAMA_CALLS, QWEN_CALLS, CallPieces

TEMPLATES = Path(__file__).parents[1] / "data" / "templates"
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30},
                                            "unit": {"enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city.",
                                           "parameters": WEATHER}}]
FORCED = {"model": "m", "temperature": 0, "max_tokens": 60, "tools": TOOLS,
          "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
          "messages": [{"role": "system", "content": "You are terse."},
                       {"role": "user", "content": "What is the weather in Lisbon?"}]}
# SmolLM2 special tokens no chat of it uses, renamed to Llama 3's (ids inside the model's vocabulary)
LLAMA_SPECIALS = {3: "<|begin_of_text|>", 4: "<|start_header_id|>", 5: "<|end_header_id|>", 6: "<|eot_id|>",
                  7: "<|eom_id|>"}


def llama_tokenizer(model_dir: Path, out: Path):
    """SmolLM2's tokenizer with Llama 3's special tokens in place of ids 3-7 and the Llama 3.2 template."""
    out.mkdir(exist_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(model_dir / name, out / name)
    spec = json.loads((out / "tokenizer.json").read_text())
    for token in spec["added_tokens"]:
        if token["id"] in LLAMA_SPECIALS:
            del spec["model"]["vocab"][token["content"]]
            token["content"] = LLAMA_SPECIALS[token["id"]]
            spec["model"]["vocab"][token["content"]] = token["id"]
    (out / "tokenizer.json").write_text(json.dumps(spec))
    config = json.loads((out / "tokenizer_config.json").read_text())
    config.update(bos_token="<|begin_of_text|>", eos_token="<|eot_id|>",
                  chat_template=(TEMPLATES / "llama-3.2-instruct.jinja").read_text())
    (out / "tokenizer_config.json").write_text(json.dumps(config))
    return AutoTokenizer.from_pretrained(out)


def _answer(sched: Scheduler, req):
    """Run ``req`` on the scheduler; its :class:`~kvchat.server.scheduler.Finished`."""
    got: queue.Queue = queue.Queue()
    sched.submit(Job(req, got.put))
    item = got.get(timeout=120)
    while item[0] == "text":
        item = got.get(timeout=120)
    assert item[0] == "done", item
    return item[1]


def _own(rt, style, messages, **kw) -> str:
    """The template's own rendering of ``messages`` with :data:`TOOLS` and ``style``'s variables."""
    fmt = rt.chat_format(new_settings([]))
    return rt.tokenizer.apply_chat_template(messages, tools=TOOLS, tokenize=False,
                                            **{**fmt.template_kwargs, **style.template, **kw})


@pytest.fixture(scope="module")
def qwen_rt(smol_info):
    """The real runtime with the Qwen3-style template in place of SmolLM2's."""
    rt = load_runtime(None, "fp8")
    rt.tokenizer.chat_template = (TEMPLATES / "qwen3.jinja").read_text()
    return rt


@pytest.fixture(scope="module")
def llama_rt(smol_info, tmp_path_factory):
    """The real runtime with Llama 3.2's template and special tokens in SmolLM2's tokenizer."""
    rt = load_runtime(None, "fp8")
    rt.tokenizer = llama_tokenizer(smol_info.path, tmp_path_factory.mktemp("llama-tokenizer"))
    return rt


def test_each_template_gets_its_style_or_the_generic_format(smol_dir, tmp_path):
    kwargs = {"date_string": "26 Jul 2024"}
    smol = AutoTokenizer.from_pretrained(smol_dir)
    assert template_tool_style(smol, kwargs) is None
    qwen = AutoTokenizer.from_pretrained(smol_dir)
    qwen.chat_template = (TEMPLATES / "qwen3.jinja").read_text()
    assert template_tool_style(qwen, kwargs) is QWEN_CALLS
    llama = llama_tokenizer(smol_dir, tmp_path / "llama")
    assert template_tool_style(llama, kwargs) is LLAMA_CALLS
    # Llama's default puts the tools in the first user message, outside the cached prefix: not followed
    assert not follows(llama, kwargs, dataclasses.replace(LLAMA_CALLS, template={}))
    # a template that fails on the probe in any way (here a ZeroDivisionError) is not followed either
    broken = AutoTokenizer.from_pretrained(smol_dir)
    broken.chat_template = "{% if tools %}{{ 1 // 0 }}{% endif %}" + (TEMPLATES / "qwen3.jinja").read_text()
    assert template_tool_style(broken, kwargs) is None
    req = parse_chat_request(json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}],
                                         "tools": TOOLS}).encode(), GENERIC)
    assert "# Tools: get_weather" in req.system and req.template_kwargs == {}


def _forced_call_round_trip(rt, style, start: str) -> None:
    """A forced named call in ``style`` on ``rt``: the prompt is the template's own rendering with the tools,
    the answer (starting ``start``) parses into tool_calls valid against the schema, the resent call renders
    to the text generated and maps back to the generated ids, and the chat continues after a tool result."""
    sched = Scheduler(rt, store=True)
    try:
        assert sched.tool_style is style
        req = parse_chat_request(json.dumps(FORCED).encode(), style)
        fmt = rt.chat_format({**new_settings([]), "template_kwargs": req.template_kwargs})
        prompt = fmt.prefix_ids(req.system, []) + fmt.user_turn_ids(req.user)
        own = _own(rt, style, FORCED["messages"], add_generation_prompt=True)
        assert prompt == rt.tokenizer.encode(own, add_special_tokens=False)
        sched.grammars.wait()
        done = _answer(sched, req)
        assert done.stats.prompt_tokens == len(prompt)
        assert done.text.startswith(start), done.text
        message, finish = answer_message(req, done.text, done.finish_reason)
        assert finish == "tool_calls", message
        [call] = message["tool_calls"]
        assert call["function"]["name"] == "get_weather"
        jsonschema.validate(json.loads(call["function"]["arguments"]), WEATHER)
        pieces = CallPieces(style)
        streamed = [d for ch in done.text for d in pieces.feed(ch)]
        assert streamed[0]["tool_calls"][0]["function"]["name"] == "get_weather"
        assert "".join(d["tool_calls"][0]["function"]["arguments"] for d in streamed) == call["function"]["arguments"]
        body = {**FORCED, "tool_choice": "none", "max_tokens": 4, "messages": FORCED["messages"] + [
            {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "tool_call_id": call["id"], "content": "21 C"}]}
        resent = parse_chat_request(json.dumps(body).encode(), style)
        assert resent.turns[0][1] == done.text  # resent in the template's own format, the text generated
        rendered = render(fmt, resent.system, resent.turns,
                          lambda ids, text: generated_answer(ids, text, rt.info.fingerprint))
        assert rendered.drift is None and rendered.token_ids[:len(prompt)] == prompt
        # the tool result is the template's own turn for a tool message (Llama's ipython turn, Qwen's user turn)
        assert resent.user_roles == ["user", style.result_role]
        result = fmt.user_turn(resent.user, resent.user_roles[-1]).ids
        whole = _own(rt, style, body["messages"], add_generation_prompt=True)
        close = rt.tokenizer.decode(fmt.assistant_close_ids(None))  # the call's assistant turn ends with it
        after_call = whole[whole.index(close, whole.rindex('"get_weather"')) + len(close):]
        assert result == rt.tokenizer.encode(after_call, add_special_tokens=False), after_call
        more = _answer(sched, resent)
        assert more.stats.prompt_tokens == len(rendered.token_ids) + len(result)
    finally:
        sched.stop()


def test_the_qwen_template_renders_the_tools_and_a_forced_call_parses_into_tool_calls(qwen_rt):
    _forced_call_round_trip(qwen_rt, QWEN_CALLS, '<tool_call>\n{"name": "get_weather", "arguments": {')
    req = parse_chat_request(json.dumps(FORCED).encode(), QWEN_CALLS)
    assert req.system == "You are terse." and req.template_kwargs == {"tools": TOOLS}


def test_the_llama_template_renders_the_tools_in_the_system_message_and_a_forced_call_parses(llama_rt):
    _forced_call_round_trip(llama_rt, LLAMA_CALLS, '{"name": "get_weather", "parameters": {')
    req = parse_chat_request(json.dumps(FORCED).encode(), LLAMA_CALLS)
    assert req.template_kwargs == {"tools_in_user_message": False, "tools": TOOLS}
    fmt = llama_rt.chat_format({**new_settings([]), "template_kwargs": req.template_kwargs})
    prefix = fmt.decode(fmt.prefix_ids(req.system, []))
    assert prefix.startswith("system\n\nEnvironment: ipython\nCutting Knowledge Date") and "get_weather" in prefix
    assert fmt.decode(fmt.user_turn("21 C", "tool").ids) == 'ipython\n\n"21 C"assistant\n\n'
