"""Text in and out: tokenizers, chat templates and sampling."""
