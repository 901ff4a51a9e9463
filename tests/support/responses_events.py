"""Checks of the Responses API's streaming event grammar, shared by the /v1/responses tests."""

from __future__ import annotations

from typing import Any

TERMINAL = ("response.completed", "response.incomplete", "response.failed")


def check_event_grammar(events: list[dict[str, Any]]) -> dict[str, Any]:
    """Every rule a client may rely on, for one stream's events (as dicts); returns the terminal response."""
    assert [e["sequence_number"] for e in events] == list(range(len(events))), "sequence numbers 0, 1, 2, ..."
    assert [e["type"] for e in events[:2]] == ["response.created", "response.in_progress"]
    terminals = [e for e in events if e["type"] in TERMINAL or e["type"] == "error"]
    assert len(terminals) == 1 and terminals[0] is events[-1], "exactly one terminal event, the last"
    response_id = events[0]["response"]["id"]
    assert all(e["response"]["id"] == response_id for e in events if "response" in e)
    items: dict[int, dict[str, Any]] = {}  # output_index -> the item as the deltas build it
    done: set[int] = set()
    for event in events[2:-1]:
        kind, index = event["type"], event.get("output_index")
        if kind == "response.output_item.added":
            assert index == len(items), "items are numbered in the order they open"
            assert all(i in done for i in items), "the previous item is done before the next opens"
            items[index] = {**event["item"], "text": "", "args": ""}
            continue
        assert index in items and index not in done, f"{kind} for an item that is not open"
        item = items[index]
        if kind == "response.output_text.delta":
            assert item["type"] == "message" and event["item_id"] == item["id"] and event["content_index"] == 0
            item["text"] += event["delta"]
        elif kind == "response.output_text.done":
            assert event["text"] == item["text"]
        elif kind == "response.reasoning_text.delta":
            assert item["type"] == "reasoning" and event["item_id"] == item["id"] and event["content_index"] == 0
            item["text"] += event["delta"]
        elif kind == "response.reasoning_text.done":
            assert item["type"] == "reasoning" and event["text"] == item["text"]
        elif kind == "response.function_call_arguments.delta":
            assert item["type"] == "function_call" and event["item_id"] == item["id"]
            item["args"] += event["delta"]
        elif kind == "response.function_call_arguments.done":
            assert event["arguments"] == item["args"]
        elif kind == "response.output_item.done":
            done.add(index)
            final = event["item"]
            assert final["id"] == item["id"] and final["status"] in ("completed", "incomplete")
            if final["type"] in ("message", "reasoning"):
                assert final["content"][0]["text"] == item["text"]
            else:
                assert final["arguments"] == item["args"] and final["call_id"] == item["call_id"]
        else:
            assert kind in ("response.content_part.added", "response.content_part.done"), kind
    assert done == set(items), "every item is done before the terminal event"
    final = events[-1]["response"]
    assert [o["id"] for o in final["output"]] == [items[i]["id"] for i in sorted(items)]
    assert final["status"] == events[-1]["type"].removeprefix("response.")
    return final
