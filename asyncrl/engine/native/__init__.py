"""The native torch rollout engine (``engine.NativeEngine``) and its parts (docs/engine.md)."""
