"""The SGLang rollout engine (``engine.SGLangEngine``) and its parts; imports nothing (see server.py)."""
