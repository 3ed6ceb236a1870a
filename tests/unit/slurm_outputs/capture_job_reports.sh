#!/usr/bin/env bash
# Capture SLURM's reports on a failed 2-component het job as `rlslurm diag` keeps them (rlslurm/slurm/commands.py
# job_report): capture_job_reports.sh OUT_DIR with SLURM_CONF set (tests/unit/slurm_outputs/README.md).
set -euo pipefail
out=${1:?out dir}
work=$(mktemp -d)
cat > "$work/job.sbatch" <<'SB'
#!/bin/bash
#SBATCH -p train -n 1 -J diagcap -o %x-%j.out
#SBATCH hetjob
#SBATCH -p rollout -n 1
srun --het-group=0,1 true
exit 3
SB
cd "$work"
id=$(sbatch --parsable job.sbatch)
for _ in $(seq 1 120); do
  state=$(scontrol show job "$id" 2>/dev/null | sed -n 's/.*JobState=\([A-Z_]*\).*/\1/p' | head -1)
  [[ "$state" == FAILED ]] && break
  sleep 0.5
done
fmt=JobID,JobName,Partition,State,ExitCode,Elapsed,NodeList,Start,End
scontrol show job "$id" > "$out/scontrol_show_job_het_failed.txt"
sleep 2  # jobcomp is written at the end
sacct -c --parsable2 --noconvert --format=$fmt -j "$id" > "$out/sacct_c_report_failed.txt"
sacct --parsable2 --noconvert --format=$fmt -j "$id" > /dev/null 2> "$out/sacct_accounting_disabled.stderr.txt" \
  || echo "sacct exited $? (no accounting database)"
echo "captured job $id into $out"
