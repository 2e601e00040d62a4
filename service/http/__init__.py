"""The HTTP door: the app and its guard, one module per route family (openai.py for
OpenAI/vLLM, tei.py, cohere.py), what they share (door.py), and JSON bodies."""
