"""vLLM's runtime LoRA endpoints: POST /v1/load_lora_adapter {"lora_name", "lora_path"} and POST
/v1/unload_lora_adapter {"lora_name"}, over router/lora.py (every replica). 200 with vLLM's plain-text
answer; a refusal in OpenAI's error shape (404: no adapter at that path, or none of that name; 400: an
adapter not served, such as a rank above --max-lora-rank or another base model's shapes; 409: a name
already loaded)."""

from __future__ import annotations

from aiohttp import web

from router.frontend import Frontend, RequestFailed
from router.openai.errors import bad_request, from_failure


async def load(frontend: Frontend, body) -> web.Response:
    name, path = _text(body, "lora_name"), _text(body, "lora_path")
    try:
        await frontend.loras.load(name, path)
    except RequestFailed as e:
        raise from_failure(e, {}) from None
    return web.Response(text=f"Success: LoRA adapter '{name}' added successfully.")


async def unload(frontend: Frontend, body) -> web.Response:
    name = _text(body, "lora_name")
    try:
        await frontend.loras.unload(name)
    except RequestFailed as e:
        raise from_failure(e, {}) from None
    return web.Response(text=f"Success: LoRA adapter '{name}' removed successfully.")


def _text(body, key: str) -> str:
    if not isinstance(body, dict):
        raise bad_request(None, "the body must be a JSON object")
    value = body.get(key) or ""
    if not isinstance(value, str):
        raise bad_request(key, f"{key} must be a string")
    return value
