"""A finished run read back: its model, tokenizer and config (``load``), scored on any data
(``evaluate``) and written out as a Hugging Face folder (``export``)."""
