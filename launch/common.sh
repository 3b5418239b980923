# Shared by the launch scripts (sourced without arguments, so it sees the script's): usage from the
# script's header comment, DRY_RUN (1 when the first argument is --dry-run; the script drops it with
# `shift "$DRY_RUN"`), and `run`, which prints the command instead of running it under --dry-run.

# absolute, so usage still finds the script after it changes directory
SCRIPT_PATH="$(cd "$(dirname "$0")" && pwd)/$(basename "$0")"

usage() {
  awk 'NR > 1 && !/^#/ { exit } NR > 1 { sub(/^# ?/, ""); print }' "$SCRIPT_PATH" >&2
  exit 2
}

run() {
  if (( DRY_RUN )); then
    printf '%q ' "$@"
    printf '\n'
  else
    "$@"
  fi
}

DRY_RUN=0
if [[ "${1:-}" == "--dry-run" ]]; then
  DRY_RUN=1
fi
