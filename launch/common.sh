# Shared by the launch scripts (sourced, not run): usage from the script's header comment, and `run`,
# which prints the command instead of running it when the script set DRY_RUN=1.

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
