# Sourced by ci/h200-session.sh and ci/kernel-cache.sh, so that both read a variant alike (the
# kernel cache filled for a variant must be the one the session's run of it looks up).
# A variant is a comma list: SMALLSEQ_* entries are environment settings (SMALLSEQ_SS_WAVES=0),
# seed=N a fuzz campaign's own seed, the others kernel defines (SS_SKIP_DEAD_TILES=3);
# `default` is the shipped build.
split_variant() { # VARIANT -> arrays envs (NAME=VALUE) and defs, and seed (may be empty)
  envs=() defs=() seed=
  local parts p
  IFS=, read -r -a parts <<< "$1"
  for p in "${parts[@]}"; do
    case $p in
      default) ;;
      seed=*) seed=${p#seed=} ;;
      SMALLSEQ_*) envs+=("$p") ;;
      *) defs+=("$p") ;;
    esac
  done
}
