"""Every request field of OpenAI's /v1/completions and /v1/chat/completions and of vLLM's extensions to
them, with what tpserve does with it, and the readers that check a field's JSON type.

A field is supported (it does what OpenAI or vLLM documents), accepted (it changes nothing a client can see
in the answer, as OpenAI documents: `user`, `metadata`), or refused: a 400 naming it, unless it has a value
that means "not used" (`n: 1`, `echo: false`). An unknown field is refused too, as OpenAI does: ignoring
it would answer a different question than the one asked. docs/reference/openai-fields.md is generated
from FIELDS (`markdown_table`, checked by tests/unit/test_docs.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from router.openai.errors import bad_request

UINT32_MAX = 2**32 - 1
BOTH, CHAT, COMPLETIONS = "both", "chat", "completions"


@dataclass(frozen=True)
class Field:
    name: str
    endpoint: str  # BOTH, CHAT or COMPLETIONS
    origin: str  # "OpenAI" or "vLLM"
    status: str  # "supported", "accepted" or "refused"
    note: str
    unused: tuple = (None,)  # refused: the values accepted as if the field were absent


def _s(name, endpoint, origin, note):
    return Field(name, endpoint, origin, "supported", note)


def _a(name, endpoint, origin, note):
    return Field(name, endpoint, origin, "accepted", note)


def _r(name, endpoint, origin, note, unused=(None,)):
    return Field(name, endpoint, origin, "refused", note, unused)


FIELDS = (
    # ---- OpenAI ----
    _s("model", BOTH, "OpenAI", "the served model's name, or any path to its directory; another: 404"),
    _s(
        "prompt",
        COMPLETIONS,
        "OpenAI",
        "a string or token ids, or a list of up to 64 of either (one choice each)",
    ),
    _s("messages", CHAT, "OpenAI", "system/developer, user, assistant (with tool_calls), tool; text content"),
    _s("max_tokens", BOTH, "OpenAI", "completions: default 16; chat: the deprecated max_completion_tokens"),
    _s("max_completion_tokens", CHAT, "OpenAI", "default: the server's --default-max-new-tokens, fitted"),
    _s("temperature", BOTH, "OpenAI", "[0, 2]; 0 is greedy"),
    _s("top_p", BOTH, "OpenAI", "(0, 1]"),
    _s("seed", BOTH, "OpenAI", "the request's own random stream"),
    _s("presence_penalty", BOTH, "OpenAI", "[-2, 2]"),
    _s("frequency_penalty", BOTH, "OpenAI", "[-2, 2]"),
    _s("stop", BOTH, "OpenAI", "a string or up to 16; not in the text (see include_stop_str_in_output)"),
    _s("logit_bias", BOTH, "OpenAI", "token id (a string key) -> [-100, 100], at most 300"),
    _s("logprobs", BOTH, "OpenAI", "completions: an int k <= 20; chat: a boolean"),
    _s("top_logprobs", CHAT, "OpenAI", "at most 20, with logprobs: true"),
    _s("stream", BOTH, "OpenAI", "server-sent events, then data: [DONE]"),
    _s("stream_options", BOTH, "OpenAI", "include_usage: a last chunk with the usage"),
    _s("tools", CHAT, "OpenAI", "type function; given to the chat template"),
    _s(
        "tool_choice",
        CHAT,
        "OpenAI",
        'none, auto (needs --tool-call-parser), "required" and a named function (the call is made by a '
        "grammar from the functions' schemas, so its arguments validate)",
    ),
    _s("parallel_tool_calls", CHAT, "OpenAI", "false: only the first tool call is returned"),
    _a("user", BOTH, "OpenAI", "an end-user id for abuse monitoring: no effect on the answer"),
    _a("metadata", CHAT, "OpenAI", "tags for stored completions: no effect on the answer"),
    _a("safety_identifier", CHAT, "OpenAI", "as user"),
    _a("prompt_cache_key", CHAT, "OpenAI", "a cache hint: prefix caching needs none"),
    _a("service_tier", CHAT, "OpenAI", "a billing tier: no effect"),
    _s("n", BOTH, "OpenAI", "[1, 16] choices sharing the prompt's KV blocks; seeded: choice i uses seed + i"),
    _s(
        "best_of",
        COMPLETIONS,
        "OpenAI",
        "[n, 16] generated, the n with the highest summed logprob kept; not streamed",
    ),
    _s("echo", BOTH, "OpenAI", "completions: the prompt before the text (and its logprobs); chat: as vLLM"),
    _r("suffix", COMPLETIONS, "OpenAI", "fill-in-the-middle needs a model's FIM template", (None, "")),
    _s("response_format", BOTH, "OpenAI", "text, json_object, json_schema (enforced, strict by default)"),
    _r("functions", CHAT, "OpenAI", "deprecated for tools", (None, [])),
    _r("function_call", CHAT, "OpenAI", "deprecated for tool_choice", (None, "none")),
    _r("store", CHAT, "OpenAI", "tpserve stores no completions", (None, False)),
    _r("modalities", CHAT, "OpenAI", "text only", (None, ["text"])),
    _r("audio", CHAT, "OpenAI", "text only"),
    _r("prediction", CHAT, "OpenAI", "predicted outputs need speculative decoding"),
    _s("reasoning_effort", CHAT, "OpenAI", "given to the chat template as reasoning_effort (as vLLM)"),
    _r("verbosity", CHAT, "OpenAI", "no such control"),
    _r("web_search_options", CHAT, "OpenAI", "no tools run on the server"),
    # ---- vLLM ----
    _s("top_k", BOTH, "vLLM", "-1 or 0: no cut"),
    _s("min_p", BOTH, "vLLM", "[0, 1]"),
    _s("repetition_penalty", BOTH, "vLLM", "(0, 10]"),
    _s("min_tokens", BOTH, "vLLM", "EOS, stop_token_ids and stop strings wait for it; <= max_tokens"),
    _s("bad_words", BOTH, "vLLM", "words never generated (tokenized with and without a leading space)"),
    _s("stop_token_ids", BOTH, "vLLM", "end at these; their text is not in the answer"),
    _s("include_stop_str_in_output", BOTH, "vLLM", "keep the stop string (or stop token) text"),
    _s("ignore_eos", BOTH, "vLLM", "generate past EOS up to max_tokens"),
    _s("skip_special_tokens", BOTH, "vLLM", "default true"),
    _s("add_special_tokens", BOTH, "vLLM", "completions: default true (BOS); chat: default false"),
    _s("add_generation_prompt", CHAT, "vLLM", "default true (false with continue_final_message)"),
    _s("continue_final_message", CHAT, "vLLM", "the model continues the last message"),
    _s("request_id", BOTH, "vLLM", "the request's id, as X-Request-Id"),
    _a("session_id", BOTH, "vLLM", "a routing hint: no effect"),
    _s("include_reasoning", CHAT, "vLLM", "false: the reasoning is left out of the answer [true]"),
    _r("use_beam_search", BOTH, "vLLM", "no beam search", (None, False)),
    _r("length_penalty", BOTH, "vLLM", "beam search only", (None, 1, 1.0)),
    _r("early_stopping", BOTH, "vLLM", "beam search only", (None, False)),
    _r("spaces_between_special_tokens", BOTH, "vLLM", "fast tokenizers decode as with true", (None, True)),
    _r("truncate_prompt_tokens", BOTH, "vLLM", "a long prompt is refused, not cut"),
    _r("truncation_side", BOTH, "vLLM", "see truncate_prompt_tokens"),
    _s(
        "prompt_logprobs",
        BOTH,
        "vLLM",
        "k <= 20 per prompt token; not with the prefix cache; chat: not streamed",
    ),
    _r("allowed_token_ids", BOTH, "vLLM", "needs an allow-list logits processor in the engine"),
    _r("logprob_token_ids", BOTH, "vLLM", "logprobs of chosen ids need the engine"),
    _s(
        "structured_outputs",
        BOTH,
        "vLLM",
        "json, regex, choice, grammar (Lark or GBNF), json_object, disable_additional_properties, "
        "disable_any_whitespace; not structural_tag",
    ),
    _s("guided_json", BOTH, "vLLM", "a JSON Schema (object or text)"),
    _s("guided_regex", BOTH, "vLLM", "the whole output matches it (Rust regex syntax)"),
    _s("guided_choice", BOTH, "vLLM", "the output is one of these strings"),
    _s("guided_grammar", BOTH, "vLLM", "a Lark or GBNF grammar"),
    _r("structural_tag", BOTH, "vLLM", "not implemented (json, regex, choice and grammar are)"),
    _a("guided_decoding_backend", BOTH, "vLLM", "llguidance always: the constraint is the same"),
    _r("guided_whitespace_pattern", BOTH, "vLLM", "JSON is always in the compact form"),
    _r("chat_template", CHAT, "vLLM", "the checkpoint's template only"),
    _s("chat_template_kwargs", CHAT, "vLLM", "extra template variables (Qwen3's enable_thinking)"),
    _r("documents", CHAT, "vLLM", "no RAG templates", (None, [])),
    _r("mm_processor_kwargs", CHAT, "vLLM", "text only"),
    _r("media_io_kwargs", CHAT, "vLLM", "text only"),
    _r("prompt_embeds", COMPLETIONS, "vLLM", "token ids or text only"),
    _s(
        "priority",
        BOTH,
        "vLLM",
        "lower is served first (vLLM's sense) [0] and preempts a lower one when the batch is full; "
        "within one, least slack first",
    ),
    _r("cache_salt", BOTH, "vLLM", "the prefix cache is not salted"),
    _r("logits_processors", BOTH, "vLLM", "no custom processors"),
    _r("return_tokens_as_token_ids", BOTH, "vLLM", "not implemented", (None, False)),
    _r("return_token_ids", BOTH, "vLLM", "not implemented", (None, False)),
    _r("return_prompt_text", CHAT, "vLLM", "not implemented", (None, False)),
    _r("kv_transfer_params", BOTH, "vLLM", "no disaggregated serving"),
    _r("ec_transfer_params", BOTH, "vLLM", "no disaggregated serving"),
    _r("vllm_xargs", BOTH, "vLLM", "no custom extensions"),
    _s(
        "thinking_token_budget",
        CHAT,
        "vLLM",
        "the think block is closed (its end tag forced) after this many tokens; needs --reasoning-parser",
    ),
    _r("repetition_detection", BOTH, "vLLM", "not implemented"),
    _r("stream_interval", BOTH, "vLLM", "each message as it comes", (None, 1)),
    _r("watermarking", BOTH, "vLLM", "not implemented", (None, False)),
    # ---- tpserve ----
    _s("ttft_objective_ms", BOTH, "tpserve", "time-to-first-token objective [the bucket's default; 0: none]"),
    _s(
        "tpot_objective_ms",
        BOTH,
        "tpserve",
        "mean time per token after the first [the default; 0: none]",
    ),
)
BY_NAME = {f.name: f for f in FIELDS}


def check_fields(body: dict, chat: bool) -> None:
    """Refuses what tpserve does not do: unknown fields, another endpoint's, and refused ones in use."""
    endpoint = CHAT if chat else COMPLETIONS
    for name, value in body.items():
        field = BY_NAME.get(name)
        if field is None:
            raise bad_request(name, f"unrecognized request field {name!r}")
        if field.endpoint not in (BOTH, endpoint):
            other = "/v1/chat/completions" if field.endpoint == CHAT else "/v1/completions"
            raise bad_request(name, f"{name} is a field of {other} only")
        if field.status == "refused" and value not in field.unused:
            raise bad_request(name, f"{name} is not supported by tpserve: {field.note}")


def markdown_table() -> str:
    """The table of request fields (docs/reference/openai-fields.md, written by docs/gen_ref.py)."""
    rows = ["| field | endpoint | from | tpserve |", "|---|---|---|---|"]
    for f in FIELDS:
        status = "**refused** (400)" if f.status == "refused" else f.status
        rows.append(f"| `{f.name}` | {f.endpoint} | {f.origin} | {status}: {f.note} |")
    return "\n".join(rows)


# ---- JSON readers: a field's type, with a message naming it ----


def kind(value) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    names = {int: "an integer", float: "a number", str: "a string", list: "an array", dict: "an object"}
    return names.get(type(value), type(value).__name__)


def number(body: dict, name: str) -> float | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise bad_request(name, f"{name} must be a number, got {kind(value)}")
    return float(value)


def integer(body: dict, name: str, low: int, high: int) -> int | None:
    """An integer that fits its proto field: the Frontend checks what it means, this that it can travel."""
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise bad_request(name, f"{name} must be an integer, got {kind(value)}")
    if not low <= value <= high:
        raise bad_request(name, f"{name} must be in [{low}, {high}], got {value}")
    return value


def boolean(body: dict, name: str, default: bool = False) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise bad_request(name, f"{name} must be a boolean, got {kind(value)}")
    return value


def strings(body: dict, name: str, single: bool = True) -> list[str]:
    """A list of strings (or one string, where the field allows it: stop)."""
    value = body.get(name)
    if value is None:
        return []
    if single and isinstance(value, str):
        return [value]
    if isinstance(value, list) and all(isinstance(s, str) for s in value):
        return value
    what = "a string or an array of strings" if single else "an array of strings"
    raise bad_request(name, f"{name} must be {what}, got {kind(value)}")


def token_ids(body: dict, name: str) -> list[int]:
    value = body.get(name)
    if value is None:
        return []
    if isinstance(value, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        if any(not 0 <= t <= UINT32_MAX for t in value):
            raise bad_request(name, f"{name} must hold token ids >= 0")
        return value
    raise bad_request(name, f"{name} must be an array of token ids")


def logit_bias(body: dict, name: str = "logit_bias") -> dict[int, float]:
    """OpenAI's shape: token ids as string keys ("50256": -100); numbers as values."""
    value = body.get(name)
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise bad_request(name, f"{name} must be an object of token id -> bias, got {kind(value)}")
    out = {}
    for key, bias in value.items():
        if not (isinstance(key, str) and key.isdigit() and int(key) <= UINT32_MAX):
            raise bad_request(name, f"{name}: keys must be token ids (digits), got {key!r}")
        if isinstance(bias, bool) or not isinstance(bias, int | float):
            raise bad_request(name, f"{name}[{key}] must be a number, got {kind(bias)}")
        out[int(key)] = float(bias)
    return out
