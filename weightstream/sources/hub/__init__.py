"""Hugging Face model ids: the Hub cache and the Hub, as a store."""
