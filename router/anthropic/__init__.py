"""Anthropic's Messages API over the router's one request path: adapters only.

- protocol.py: /v1/messages and /v1/messages/count_tokens bodies -> the chat completions body that asks the
  same, read by router/openai/protocol.py into the one internal request.
- encoder.py: the chat answer and its chunks -> Anthropic's Message and stream events; its error shape.
- server.py: the two routes on the HTTP server (router/openai/server.py).
"""
