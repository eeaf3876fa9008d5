"""What a run leaves behind, served: the policy and its drafter exported side by side at each save
(`export.py`), vLLM's OpenAI-compatible server on the newest export (`server.py`), and an HTTP
client that compares it with and without the drafter (`client.py`)."""
