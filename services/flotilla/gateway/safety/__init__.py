"""The gateway's safety stage: prompts screened before admission, generated text screened as it streams.

A policy (policy.py) answers `screen_input(text) -> Verdict` and makes one OutputScreen per answer: fed each
text delta, it clears the text it judged safe and holds back at most its window of characters until it is
judged (verdict.py). Built-in policies: rules (rules.py: literal terms and RE2 regular expressions by
category) and an external HTTP classifier (classifier.py: the OpenAI moderation shape, batched). Which
policy serves a request is the key record's `safety_policy`, else the configured default (config.py).
stage.py is the glue to the dialects: 400 for a blocked prompt, ScreenedEvents for the answer.
"""
