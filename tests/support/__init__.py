"""What the tests share: tiny models, engine and server harnesses, shared requests and fixtures' helpers."""
