"""The OpenAI-compatible HTTP API (with vLLM's extensions): one idea a file.

- server.py: the aiohttp app, thin handlers over the Frontend (router/frontend.py).
- fields.py: every request field OpenAI and vLLM define, supported or refused, and the JSON readers.
- protocol.py: /v1/completions and /v1/chat/completions bodies -> GenerateRequest.
- tools.py: tools, tool_choice and tool turns in a chat request.
- tool_parsers.py: tool calls parsed out of the model's text (hermes, llama3_json, mistral), streamed.
- encoder.py: GenerateResponses -> OpenAI's answers and stream chunks.
- answer.py: one request started through the Frontend and read as chat chunks: what every HTTP API renders
  (chat completions as they are; router/anthropic/ and the Responses API as their own events).
- responses.py, responses_output.py, responses_server.py: the Responses API (/v1/responses): bodies -> the
  chat body, the chat answer -> response objects and events, the routes and the stored responses.
- tokenize.py: vLLM's /tokenize and /detokenize.
- errors.py: OpenAI's error shape and the one mapping from the Frontend's failures.
"""
