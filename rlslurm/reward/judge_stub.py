"""A stand-in OpenAI-compatible judge for tests and the bench: fixed latency, deterministic marks.

    python -m rlslurm.reward.judge_stub --port 9000 --latency-s 2

POST /v1/chat/completions answers after `latency_s` (an asyncio sleep, so any number of requests
wait at once, like a judge served by a batching engine). The mark: `SCORE: 9` when the answer to
grade contains the reference answer, `SCORE: 2` when not, and a reply with no mark at all when the
answer contains the word "garble" (to exercise the scorer's parse failures).
"""

from __future__ import annotations

import asyncio
import re

import click
import uvicorn
from fastapi import FastAPI


def make_stub_app(latency_s: float) -> FastAPI:
    app = FastAPI(title="judge stub")
    app.state.requests = 0

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok", "requests": app.state.requests}

    @app.post("/v1/chat/completions")
    async def chat(body: dict) -> dict:
        app.state.requests += 1
        await asyncio.sleep(latency_s)
        user = body["messages"][-1]["content"]
        found = re.search(r"Reference answer:\n(.*)\n\nAnswer to grade:\n(.*)", user, re.DOTALL)
        reference, answer = (found.group(1), found.group(2)) if found else ("", user)
        if "garble" in answer:
            text = "The answer looks reasonable overall."
        else:
            text = "SCORE: 9" if reference and reference in answer else "SCORE: 2"
        return {"id": f"stub-{app.state.requests}", "object": "chat.completion", "model": body.get("model", "stub"),
                "choices": [{"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": text}}]}

    return app


@click.command()
@click.option("--port", type=int, required=True)
@click.option("--latency-s", type=float, default=2.0, show_default=True, help="Seconds before each reply.")
def main(port: int, latency_s: float) -> None:
    """Serve the stub judge on 127.0.0.1 until killed."""
    uvicorn.run(make_stub_app(latency_s), host="127.0.0.1", port=port, log_level="warning", backlog=4096)


if __name__ == "__main__":
    main()
