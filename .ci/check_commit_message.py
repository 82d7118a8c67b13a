"""A commit message's form (pre-commit's commit-msg hook): a subject of at most 72 characters, then,
if there is more, a blank line before the body.

    python .ci/check_commit_message.py MESSAGE_FILE       exit 1 with the reason if it is not so
"""

import sys

MAX_SUBJECT = 72


def problem(message: str) -> str | None:
  """Why `message` is not a subject line and a body, or None."""
  lines = [line for line in message.splitlines() if not line.startswith('#')]
  if not lines or not lines[0].strip():
    return 'the first line (the subject) is empty'
  if len(lines[0]) > MAX_SUBJECT:
    return f'the subject is {len(lines[0])} characters; at most {MAX_SUBJECT}'
  if len(lines) > 1 and lines[1].strip():
    return 'the second line must be blank: a subject, a blank line, then the body'
  return None


if __name__ == '__main__':
  with open(sys.argv[1], encoding='utf-8') as f:
    reason = problem(f.read())
  if reason:
    print(f'commit message: {reason}', file=sys.stderr)
    sys.exit(1)
