"""Tool calls: the request's tools and tool_choice, how they reach the prompt, and how calls are read back.

Rendering: a chat template that mentions `tools` gets them as the `tools` variable (transformers
semantics). Any other template gets the default format, Hermes style (the one Qwen2.5, SmolLM
and many fine-tunes were trained on): a system message listing the tools as JSON inside
<tools></tools> and asking for <tool_call>{"name": ..., "arguments": {...}}</tool_call>;
assistant tool calls are written back in that form and `tool` messages become user messages
holding <tool_response>...</tool_response>, so a multi-turn tool conversation round-trips.

Decoding:
- tool_choice "required": the output is constrained (structured_outputs) to a JSON array of
  {"name": <one of the tools>, "arguments": <its parameters schema>} (the default format's
  objects; one item unless parallel_tool_calls), so even a small model produces valid calls.
- a named function: the output is constrained to that function's parameters schema; the whole
  output is the call's arguments.
- "auto": the model writes what it likes; a parser for the model family's format (hermes,
  llama3_json) finds the calls.

Every mode reads calls the same way (CallScanner): a call's `arguments` is the exact text the
model wrote for that JSON value, so streamed argument pieces concatenate to the non-streaming
result.
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field

PARSERS = ("hermes", "llama3_json")
_NAME = re.compile(r'"name"\s*:\s*"((?:[^"\\]|\\.)*)"')
_ARGS = re.compile(r'"(?:arguments|parameters)"\s*:\s*')
_HERMES_OPEN = "<tool_call>"
_PYTHON_TAG = "<|python_tag|>"


@dataclass
class ToolSpec:
    """The validated tool fields of a chat request."""

    tools: list[dict]  # OpenAI tool objects ({"type": "function", "function": {...}})
    choice: str  # "none" | "auto" | "required" | "named"
    named: str | None = None  # the function name when choice == "named"
    parallel: bool = True

    @property
    def functions(self) -> list[dict]:
        return [t["function"] for t in self.tools]

    def schema(self) -> dict | None:
        """The JSON schema that constrains the output (required / named), else None."""
        if self.choice == "named":
            fn = next(f for f in self.functions if f["name"] == self.named)
            return fn.get("parameters") or {"type": "object"}
        if self.choice != "required":
            return None
        defs, items = {}, []
        for i, f in enumerate(self.functions):
            params = f.get("parameters") or {"type": "object"}
            arguments = params
            if _has_refs(params):  # its references are relative to its own root: give it a place in ours
                defs[f"tool_{i}"] = _reroot(params, f"#/$defs/tool_{i}")
                arguments = {"$ref": f"#/$defs/tool_{i}"}
            items.append({"type": "object", "properties": {"name": {"const": f["name"]}, "arguments": arguments},
                          "required": ["name", "arguments"]})
        schema = {"type": "array", "items": {"anyOf": items}, "minItems": 1}
        if not self.parallel:
            schema["maxItems"] = 1
        if defs:
            schema["$defs"] = defs
        return schema


def _has_refs(node) -> bool:
    if isinstance(node, dict):
        return "$ref" in node or any(_has_refs(v) for v in node.values())
    return isinstance(node, list) and any(_has_refs(v) for v in node)


def _reroot(node, base: str):
    """A copy of a schema whose local references ("#...") point into it where it sits at `base`;
    other references stay as they are (and are refused when compiled)."""
    if isinstance(node, dict):
        out = {}
        for key, value in node.items():
            if key == "$ref" and isinstance(value, str) and value.startswith("#"):
                out[key] = base + value[1:]
            else:
                out[key] = _reroot(value, base)
        return out
    if isinstance(node, list):
        return [_reroot(v, base) for v in node]
    return node


def parse_tools(body: dict, invalid) -> ToolSpec | None:
    """tools / tool_choice / parallel_tool_calls of a chat body; invalid(param, message) makes the 400."""
    tools = body.get("tools")
    choice = body.get("tool_choice")
    parallel = body.get("parallel_tool_calls", True)
    if parallel is None:
        parallel = True
    if not isinstance(parallel, bool):
        raise invalid("parallel_tool_calls", "'parallel_tool_calls' must be a boolean")
    if tools is None:
        if choice not in (None, "none"):
            raise invalid("tool_choice", "'tool_choice' needs 'tools'")
        return None
    if not isinstance(tools, list):
        raise invalid("tools", "'tools' must be a list of tools")
    names = set()
    for i, t in enumerate(tools):
        p = f"tools[{i}]"
        if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(t.get("function"), dict):
            raise invalid(p, f"'{p}' must be {{\"type\": \"function\", \"function\": {{...}}}}; "
                          "only function tools are supported")
        fn = t["function"]
        if not isinstance(fn.get("name"), str) or not re.fullmatch(r"[A-Za-z0-9_.-]{1,64}", fn["name"]):
            raise invalid(f"{p}.function.name", f"'{p}.function.name' must be 1-64 letters, digits, _ . or -")
        if fn["name"] in names:
            raise invalid(f"{p}.function.name", f"'{p}.function.name' {fn['name']!r} is defined twice")
        names.add(fn["name"])
        if fn.get("parameters") is not None and not isinstance(fn["parameters"], dict):
            raise invalid(f"{p}.function.parameters", f"'{p}.function.parameters' must be a JSON schema object")
    if choice is None:
        choice = "auto" if tools else "none"
    if isinstance(choice, dict):
        fn = choice.get("function")
        name = fn.get("name") if isinstance(fn, dict) else None
        if choice.get("type") != "function" or not isinstance(name, str):
            raise invalid("tool_choice", "'tool_choice' must be none, auto, required or "
                          "{\"type\": \"function\", \"function\": {\"name\": ...}}")
        if name not in names:
            raise invalid("tool_choice", f"'tool_choice' names function {name!r}, which is not in 'tools'")
        return ToolSpec(tools, "named", name, parallel)
    if choice not in ("none", "auto", "required"):
        raise invalid("tool_choice", f"'tool_choice' must be none, auto, required or a named function, got {choice!r}")
    if choice != "none" and not tools:
        raise invalid("tools", f"tool_choice {choice!r} needs at least one tool")
    return ToolSpec(tools, choice, None, parallel)


# ---------------------------------------------------------------- rendering
def template_takes_tools(template: str | None) -> bool:
    return bool(template) and "tools" in template


def default_tool_prompt(functions: list[dict]) -> str:
    listing = "\n".join(json.dumps({"type": "function", "function": f}, ensure_ascii=False) for f in functions)
    return ("You may call one or more functions to assist with the user query. The available functions, "
            f"as JSON, are:\n<tools>\n{listing}\n</tools>\nFor each function call, answer with a JSON object "
            "holding the function name and arguments inside <tool_call></tool_call> tags:\n"
            '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>')


def render_default(messages: list[dict], functions: list[dict] | None) -> list[dict]:
    """Messages for a template without tool support, in the default (Hermes) format."""
    out = []
    for m in messages:
        if m["role"] == "assistant" and m.get("tool_calls"):
            calls = "\n".join(f"{_HERMES_OPEN}\n{json.dumps(_call_json(c), ensure_ascii=False)}\n</tool_call>"
                              for c in m["tool_calls"])
            out.append({"role": "assistant", "content": (m["content"] + "\n" if m["content"] else "") + calls})
        elif m["role"] == "tool":
            out.append({"role": "user", "content": f"<tool_response>\n{m['content']}\n</tool_response>"})
        else:
            out.append({"role": m["role"], "content": m["content"]})
    if functions:
        prompt = default_tool_prompt(functions)
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": out[0]["content"] + "\n\n" + prompt}
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out


def _call_json(call: dict) -> dict:
    fn = call.get("function") or {}
    args = fn.get("arguments")
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            pass
    return {"name": fn.get("name"), "arguments": args}


# ---------------------------------------------------------------- reading calls back
def _value_end(text: str, start: int) -> int | None:
    """The index after the JSON object or array starting at text[start], or None while it is open."""
    depth, in_str, esc = 0, False, False
    for i in range(start, len(text)):
        c = text[i]
        if in_str:
            if esc:
                esc = False
            elif c == "\\":
                esc = True
            elif c == '"':
                in_str = False
        elif c == '"':
            in_str = True
        elif c in "{[":
            depth += 1
        elif c in "}]":
            depth -= 1
            if depth == 0:
                return i + 1
    return None


def _read_call(text: str, start: int) -> tuple[str | None, str, int | None]:
    """(name, arguments text so far, end of the call object) for a call object at text[start]."""
    end = _value_end(text, start)
    body = text[start:end] if end is not None else text[start:]
    args_m = _ARGS.search(body)
    name_m = _NAME.search(body, 0, args_m.start() if args_m else len(body))  # the name comes first
    if name_m is None or args_m is None or not body[args_m.end():].lstrip()[:1] in ("{", "["):
        return (json.loads(f'"{name_m.group(1)}"') if name_m else None), "", end
    a0 = args_m.end() + len(body[args_m.end():]) - len(body[args_m.end():].lstrip())
    a_end = _value_end(body, a0)
    return json.loads(f'"{name_m.group(1)}"'), body[a0:a_end] if a_end is not None else body[a0:], end


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


@dataclass
class Call:
    name: str | None
    arguments: str  # the text the model wrote for the arguments so far
    start: int  # where the call's text starts in the output
    complete: bool  # its object (or, for a named function, its arguments) is closed, and they are JSON


@dataclass
class Parsed:
    content: str  # text that is not a tool call (streamable so far)
    calls: list[Call]

    def handed_out(self) -> list[Call]:
        """The calls a client gets: the complete ones before the first that is not."""
        out = []
        for c in self.calls:
            if not c.complete:
                break
            out.append(c)
        return out


class CallScanner:
    """Reads calls from the text generated so far (any prefix of the final output). A call that is
    still open, or was cut (max_tokens), is not a call: at the end its text joins the content."""

    def __init__(self, spec: ToolSpec, parser: str) -> None:
        self.spec = spec
        self.parser = parser
        self.names = {f["name"] for f in spec.functions}

    def parse(self, text: str, final: bool) -> Parsed:
        parsed = self._parse(text, final)
        if final:  # what follows the last complete call was meant as a call and never became one
            calls = parsed.handed_out()
            if len(calls) < len(parsed.calls):
                parsed = Parsed(parsed.content + text[parsed.calls[len(calls)].start:], calls)
        return parsed

    def _parse(self, text: str, final: bool) -> Parsed:
        if self.spec.choice == "named":
            args = text.lstrip()
            closed = _value_end(args, 0) == len(args.rstrip()) if args[:1] in ("{", "[") else False
            return Parsed("", [Call(self.spec.named, args, 0, closed and _is_json(args))])
        if self.spec.choice == "required":
            return Parsed("", self._objects(text, 0))
        if self.parser == "llama3_json":
            return self._llama3(text, final)
        return self._hermes(text, final)

    def _call(self, text: str, i: int) -> tuple[Call, int | None]:
        name, args, end = _read_call(text, i)
        complete = end is not None and name in self.names and bool(args) and _is_json(args)
        return Call(name, args, i, complete), end

    def _objects(self, text: str, pos: int) -> list[Call]:
        """Call objects one after another from pos (in a JSON array, or separated by `;`)."""
        calls = []
        while True:
            i = text.find("{", pos)
            if i < 0:
                return calls
            call, end = self._call(text, i)
            calls.append(call)
            if end is None:
                return calls
            pos = end

    def _hermes(self, text: str, final: bool) -> Parsed:
        first = text.find(_HERMES_OPEN)
        if first < 0:
            keep = len(text) if final else _without_partial_tag(text, _HERMES_OPEN)
            return Parsed(text[:keep], [])
        calls = []
        pos = first
        while (pos := text.find(_HERMES_OPEN, pos)) >= 0:
            i = text.find("{", pos)
            if i < 0:
                calls.append(Call(None, "", pos, False))
                break
            call, end = self._call(text, i)
            call.start = pos
            calls.append(call)
            if end is None:
                break
            pos = end
        return Parsed(text[:first], calls)

    def _llama3(self, text: str, final: bool) -> Parsed:
        lead = len(text) - len(text.lstrip())
        stripped = text[lead:]
        if stripped.startswith(_PYTHON_TAG):
            stripped = stripped[len(_PYTHON_TAG):].lstrip()
        if not final and _PYTHON_TAG.startswith(stripped):  # nothing decided yet (empty or a partial tag)
            return Parsed("", [])
        if not stripped.startswith("{"):
            return Parsed(text, [])
        offset = len(text) - len(stripped)
        calls = self._objects(stripped, 0)
        for c in calls:
            c.start += offset
        if calls:
            calls[0].start = 0  # the tag and blanks before the first call belong to it
        return Parsed("", calls)


def _without_partial_tag(text: str, tag: str) -> int:
    """len(text) minus a trailing prefix of tag (it may become the tag with the next token)."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return len(text) - k
    return len(text)


def choose_parser(flag: str | None, chat_template: str | None) -> str:
    """--tool-call-parser if given, else by the model's template: Llama-3 templates mention
    <|python_tag|> / ipython; everything else gets hermes."""
    if flag:
        return flag
    if chat_template and ("<|python_tag|>" in chat_template or "ipython" in chat_template):
        return "llama3_json"
    return "hermes"


@dataclass
class ToolStream:
    """One chat choice's tool-call state: what has been sent, and the OpenAI deltas for what is new."""

    scanner: CallScanner
    text: str = ""
    sent_content: int = 0
    sent_args: list[int] = field(default_factory=list)  # per announced call: argument chars sent
    ids: list[str] = field(default_factory=list)

    def feed(self, piece: str, final: bool) -> tuple[str, list[dict]]:
        """Append generated text; return (new content text, new tool_call delta entries). A call is
        announced only once it is complete: its header (id, name) and then its whole arguments."""
        self.text += piece
        parsed = self.scanner.parse(self.text, final)
        content = parsed.content[self.sent_content:]
        self.sent_content = len(parsed.content)
        deltas = []
        for k, call in enumerate(parsed.handed_out()):
            if k < len(self.sent_args):
                continue
            self.ids.append(f"call_{uuid.uuid4().hex[:24]}")
            self.sent_args.append(len(call.arguments))
            deltas.append({"index": k, "id": self.ids[k], "type": "function",
                           "function": {"name": call.name, "arguments": ""}})
            deltas.append({"index": k, "function": {"arguments": call.arguments}})
        return content, deltas

    def message(self) -> tuple[str | None, list[dict]]:
        """The final (content, tool_calls) of the whole output (call after the last feed)."""
        parsed = self.scanner.parse(self.text, True)
        calls = []
        for k, call in enumerate(parsed.handed_out()):
            while len(self.ids) <= k:
                self.ids.append(f"call_{uuid.uuid4().hex[:24]}")
            calls.append({"id": self.ids[k], "type": "function",
                          "function": {"name": call.name, "arguments": call.arguments}})
        content = parsed.content if parsed.content.strip() or not calls else None
        return content, calls
