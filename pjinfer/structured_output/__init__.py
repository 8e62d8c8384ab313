"""Structured outputs: constrain generation to a JSON schema, regex, choice or grammar."""
