"""`inflight router`: one OpenAI-compatible endpoint for many models, routed by model and prompt prefix."""
