"""sbatch scripts read as Slurm reads them, one rule per test (README: "Coming from Slurm")."""

from __future__ import annotations

import subprocess

import pytest

from services.jobfiles import Context, JobFileError, SiteMap, Translated, from_sbatch
from services.jobfiles.common import Partition
from services.jobfiles.sbatch_options import ArraySpec, Dependency, parse_array, parse_dependency
from services.scheduler.api import JobRequest


def script(*directives: str, body: str = "python train.py\n", shebang: str = "#!/bin/bash") -> str:
    return shebang + "\n" + "".join(f"#SBATCH {d}\n" for d in directives) + body


def read(*directives: str, ctx: Context = Context(), **kw: str) -> Translated:
    return from_sbatch(script(*directives, **kw), "job.sh", ctx)


def job(*directives: str, ctx: Context = Context(), **kw: str) -> JobRequest:
    """The job POST /v1/jobs would take for a script with these directives."""
    return JobRequest.model_validate(read(*directives, ctx=ctx, **kw).job)


def test_hold_submits_the_job_held_as_sbatch_h_does():
    for d in ("--hold", "-H"):
        assert job(d, "--gpus=1").hold is True
        assert not any("hold" in w for w in read(d, "--gpus=1").warnings)
    assert job("--gpus=1").hold is False


def refusal(*directives: str, ctx: Context = Context()) -> str:
    with pytest.raises(JobFileError) as e:
        read(*directives, ctx=ctx)
    return str(e.value)


def warned(t: Translated, *parts: str) -> bool:
    return any(all(p in w for p in parts) for w in t.warnings)


# --- reading the directives -------------------------------------------------------------------


def test_a_directive_splits_like_a_shell_line_so_quotes_are_removed_and_a_trailing_comment_ignored():
    assert job('--job-name="hg"    # the name').name == "hg"
    assert job("-J 'two words'  # name").name == "two-words"


@pytest.mark.parametrize("directives", [
    ("-J name", "-c 16", "-t 1-00:00"), ("--job-name name", "--cpus-per-task 16", "--time 1440"),
    ("-Jname", "-c16", "-t1440"), ("--job-name=name", "--cpus-per-task=16", "--time=24:00:00"),
    ("-J name -c 16 -t 1-00:00:00",),
], ids=["short spaced", "long spaced", "short attached", "long with =", "one line"])
def test_short_and_long_options_take_their_value_attached_after_an_equals_sign_or_as_the_next_word(directives):
    j = job(*directives)
    assert (j.name, j.resources.cpu_milli, j.time_limit_s) == ("name", 16000, 86400)


def test_the_value_of_a_short_option_is_never_taken_for_an_option():
    assert job("-p admin").queue == "admin"
    assert job("--account ml").queue == "ml"


def test_a_long_option_may_be_shortened_to_any_unambiguous_prefix_as_getopt_allows():
    assert job("--cpus-per-t=4", "--job=x").resources.cpu_milli == 4000
    assert "--mem-per" in refusal("--mem-per=4G") and "write the option in full" in refusal("--mem-per=4G")


def test_reading_stops_at_the_first_command_and_later_directives_are_ignored_with_a_warning():
    t = read("--gres=gpu:1", body="echo start\n#SBATCH --gres=gpu:8\npython train.py\n")
    assert JobRequest.model_validate(t.job).resources.gpus == 1
    assert warned(t, "line 4", "ignored")


def test_double_hash_and_indented_sbatch_lines_are_comments():
    j = JobRequest.model_validate(from_sbatch("#!/bin/bash\n##SBATCH --gres=gpu:8\n  #SBATCH --gres=gpu:4\n"
                                              "#SBATCH --gres=gpu:2\necho\n", "x.sh").job)
    assert j.resources.gpus == 2


def test_a_word_that_is_no_option_is_refused_with_how_to_quote_it():
    message = refusal("--job-name my job")
    assert "'job' is no option" in message and '--job-name="my job"' in message


@pytest.mark.parametrize("written,seconds", [
    ("60", 3600), ("4320", 259200), ("10:30", 630), ("1:00:00", 3600), ("2-12", 216000), ("2-12:30", 217800),
    ("1-00:00:00", 86400), ("0-04:00", 14400), ("UNLIMITED", None), ("INFINITE", None), ("0", None),
])
def test_every_slurm_time_format_is_read(written: str, seconds: int | None):
    assert job(f"--time={written}").time_limit_s == seconds


def test_a_time_in_no_slurm_format_is_refused_naming_the_formats():
    assert "D-HH:MM:SS" in refusal("--time=1h")


# --- tasks, nodes and GPUs ------------------------------------------------------------------


def test_gres_is_per_node_and_split_over_that_nodes_tasks():
    j = job("--nodes=1", "--ntasks-per-node=4", "--gres=gpu:8")
    assert (j.tasks, j.resources.gpus, j.topology) == (4, 2, "node")


def test_ntasks_with_per_node_gpus_shares_the_node_gpus_rather_than_multiplying_them():
    j = job("--ntasks=4", "--gres=gpu:4")
    assert (j.tasks, j.resources.gpus, j.topology) == (4, 1, "node")


def test_per_node_gpus_that_do_not_split_into_whole_gpus_per_task_are_refused_saying_what_to_write():
    message = refusal("--ntasks=24", "--gres=gpu:4")
    assert "--gres=gpu:4" in message and "--ntasks-per-node=4" in message


def test_nodes_means_that_many_distinct_nodes_with_the_same_tasks_on_each():
    j = job("--nodes=2", "--gres=gpu:8")
    assert (j.tasks, j.tasks_per_node, j.resources.gpus) == (2, 1, 8)
    j = job("-N 4", "--ntasks-per-node=8", "--gpus-per-node=8")
    assert (j.tasks, j.tasks_per_node, j.resources.gpus) == (32, 8, 1)
    j = job("-N 2", "-n 8", "--gpus-per-task=1")
    assert (j.tasks, j.tasks_per_node) == (8, 4)


def test_tasks_that_do_not_split_evenly_over_the_nodes_are_refused():
    assert "--ntasks-per-node" in refusal("--nodes=2", "--ntasks=5")


def test_gpus_for_the_job_are_split_over_all_its_tasks():
    j = job("--ntasks=4", "--gpus=8")
    assert (j.tasks, j.resources.gpus, j.topology) == (4, 2, "any")
    assert "--gpus-per-task" in refusal("--ntasks=3", "--gpus=4")


def test_gpus_per_task_are_per_task_and_the_tasks_go_wherever_they_fit():
    j = job("-n 3", "--gpus-per-task=2")
    assert (j.tasks, j.resources.gpus, j.topology, j.tasks_per_node) == (3, 2, "any", None)


def test_gpu_directives_that_agree_may_be_given_together_and_ones_that_disagree_are_refused():
    j = job("-N 4", "--ntasks-per-node=4", "--gpus-per-task=1", "--gpus-per-node=4")
    assert (j.tasks, j.resources.gpus) == (16, 1)
    assert "disagree" in refusal("-N 1", "--ntasks-per-node=4", "--gpus-per-task=1", "--gpus-per-node=8")


def test_a_script_without_gpus_is_a_cpu_job():
    j = job("--ntasks=1", "--cpus-per-task=16")
    assert (j.resources.gpus, j.resources.cpu_milli) == (0, 16000)


def test_the_gpu_type_of_gres_gpus_per_node_or_gpus_is_a_model_filter():
    assert set(job("--gres=gpu:a100:4").gpu.models) >= {"A100-SXM4-40GB", "A100-SXM4-80GB"}
    assert job("--gpus-per-node=h100:8").gpu.models[0] == "H100-80GB"
    assert job("--gpus=t4:1").gpu.models == ("T4",)
    assert set(job("--gres=gpu:a100_80g:1").gpu.models) == {"A100-SXM4-80GB", "A100-80GB-PCIe"}
    assert "A10" not in job("--gres=gpu:a100:1").gpu.models and job("--gres=gpu:a10:1").gpu.models == ("A10",)


def test_a_gpu_type_known_nowhere_is_asked_as_written_with_a_warning():
    t = read("--gres=gpu:rtx8000x:1")
    assert JobRequest.model_validate(t.job).gpu.models == ("RTX8000X",) and warned(t, "rtx8000x")


def test_a_mig_gres_type_is_a_mig_slice():
    j = job("--gres=gpu:1g.10gb:1")
    assert (j.gpu.mig, j.resources.gpus) == ("1g.10gb", 1)


def test_the_gpu_models_of_the_cluster_are_matched_too():
    ctx = Context(models=("A100-SXM4-40GB", "B300-SXM6-288GB"))
    assert job("--gres=gpu:b300:8", ctx=ctx).gpu.models == ("B300-SXM6-288GB",)


# --- CPU and memory -----------------------------------------------------------------------------


def test_cpus_per_gpu_and_mem_per_gpu_scale_with_the_gpus_of_each_task():
    j = job("--gpus-per-task=2", "--cpus-per-gpu=6", "--mem-per-gpu=40G")
    assert (j.resources.cpu_milli, j.resources.memory_mib) == (12000, 81920)


def test_mem_is_per_node_and_mem_per_cpu_is_per_cpu_of_a_task():
    assert job("-N 1", "--ntasks-per-node=4", "--mem=64G").resources.memory_mib == 16384
    assert job("-c 4", "--mem-per-cpu=2G").resources.memory_mib == 8192
    assert job("--mem=4000").resources.memory_mib == 4000
    t = read("--mem=0")
    assert JobRequest.model_validate(t.job).resources.memory_mib == 0 and warned(t, "--mem=0")


# --- queue, priority, model filter from the site -----------------------------------------------


def test_the_partition_is_the_queue_unless_the_site_maps_it_to_gpu_models_or_a_queue():
    assert job("-p gpu").queue == "gpu"
    site = SiteMap(partitions={"gpu-h100": Partition(models=("H100-80GB",)), "nlp": Partition(queue="research.nlp")})
    j = job("-p gpu-h100", "--gres=gpu:1", ctx=Context(site=site))
    assert (j.queue, j.gpu.models) == ("default", ("H100-80GB",))
    assert job("-p nlp", ctx=Context(site=site)).queue == "research.nlp"


def test_the_account_is_the_queue_and_wins_over_an_unmapped_partition():
    t = read("-p gpu", "-A nlp")
    assert t.job["queue"] == "nlp" and warned(t, "-p gpu", "ignored")


def test_a_queue_named_by_its_leaf_is_the_one_known_path_ending_in_it():
    ctx = Context(queues=("default", "research.nlp", "research.vision"))
    assert job("--account=nlp", ctx=ctx).queue == "research.nlp"
    ctx = Context(queues=("a.nlp", "b.nlp"))
    assert "could be any of a.nlp, b.nlp" in str(read("--account=nlp", ctx=ctx).warnings)


def test_an_account_that_cannot_name_a_queue_is_a_warning_and_the_job_goes_to_the_default_queue():
    t = read("--account=abc@v100")
    assert "queue" not in t.job and warned(t, "abc@v100")


@pytest.mark.parametrize("qos,priority", [("high", "high"), ("gpu_high", "high"), ("scavenger", "low"),
                                          ("low", "low"), ("normal", "normal"), ("qos_gpu-t3", "normal")])
def test_qos_sets_the_priority_by_its_words(qos: str, priority: str):
    assert job(f"--qos={qos}").priority == priority


def test_a_site_maps_its_own_qos_names():
    assert job("-q debug", ctx=Context(site=SiteMap(qos={"debug": "high"}))).priority == "high"


def test_constraint_names_gpu_models_or_a_gpu_family_and_other_features_are_warnings():
    assert set(job("--gres=gpu:1", "--constraint=a100|h100").gpu.models) >= {"A100-SXM4-40GB", "H100-80GB"}
    assert set(job("--gres=gpu:1", "-C v100&32gb").gpu.models) == {"V100-SXM2-32GB", "V100-PCIE-32GB"}
    assert job("--gres=gpu:1", "-C volta").gpu.min_compute_capability == "7.0"
    t = read("--gres=gpu:1", "-C ib")
    assert "gpu" not in t.job and warned(t, "-C ib", "no GPU model")


def test_a_gpu_type_and_a_constraint_that_allow_no_model_together_are_refused():
    assert "allow no GPU model together" in refusal("--gres=gpu:a100:1", "--constraint=h100")


# --- refused, warned, recorded ----------------------------------------------------------------


@pytest.mark.parametrize("directive", ["-w gpu-07", "--nodelist=gpu-[01-04]", "-x gpu-07", "--exclude=gpu-07"])
def test_naming_nodes_is_refused_saying_what_to_write_instead(directive: str):
    message = refusal(directive, "--gres=gpu:1")
    assert directive in message and "drop it" in message


def test_an_array_becomes_the_request_s_array_with_its_indices_and_limit():
    assert parse_array("0-15:4%2", "--array") == ArraySpec((0, 4, 8, 12), 2)
    assert parse_array("1,3,5-7", "--array") == ArraySpec((1, 3, 5, 6, 7))
    req = job("--array=1-100%10")
    assert req.array is not None and req.array.indices == tuple(range(1, 101)) and req.array.max_running == 10


@pytest.mark.parametrize("value", ["0-10000", "0-999999999", "1-5%0", "3-1"])
def test_an_array_too_large_or_empty_or_with_no_room_to_run_is_refused_before_its_indices_are_listed(value: str):
    assert f"--array={value}" in refusal(f"--array={value}")


def test_dependencies_become_the_request_s_dependencies_and_singleton():
    assert parse_dependency("afterok:12:13,afterany:14", "-d") == (
        (Dependency("afterok", ("12", "13")), Dependency("afterany", ("14",))), False)
    assert parse_dependency("afterok:1?afternotok:2", "-d")[1] is True
    req = job("-d afterok:j-1:j-2_3,afternotok:j-4,singleton")
    assert [(d.kind, d.job) for d in req.dependencies] == [("afterok", "j-1"), ("afterok", "j-2-3"),
                                                          ("afternotok", "j-4")]
    assert req.singleton


@pytest.mark.parametrize("value, says", [("afterok:1?afternotok:2", "not any one"), ("after:j-1", "after is not"),
                                         ("aftercorr:j-1", "aftercorr is not"), ("afterok", "names no job"),
                                         ("afterok:J.1", "no gpuorch job id")])
def test_dependencies_gpuorch_cannot_wait_for_are_refused_saying_what_it_can(value: str, says: str):
    assert says in refusal(f"--dependency={value}")


def test_output_and_error_are_recorded_and_the_warning_says_where_the_output_is():
    t = read("-o out/%x-%j.log", "--error=err/%j.log")
    assert t.logs == {"output": "out/%x-%j.log", "error": "err/%j.log"} and warned(t, "gpuorch logs")


def test_requeue_allows_retries_after_a_lost_node_and_no_requeue_none():
    assert job("--requeue").max_retries == 5
    assert job("--no-requeue").max_retries == 0


def test_options_that_change_nothing_that_runs_are_warnings_not_refusals():
    t = read("--exclusive", "--mail-type=END", "--hint=nomultithread", "--begin=now+1hour", "--gres=gpu:1")
    assert warned(t, "--exclusive", "ignored") and warned(t, "--begin") and warned(t, "--hint=nomultithread")


def test_an_option_sbatch_does_not_know_is_a_warning():
    t = read("--nvmps", "--site-flag value", "--gres=gpu:1")
    assert warned(t, "--nvmps", "not an sbatch option") and warned(t, "--site-flag value")


# --- what runs ---------------------------------------------------------------------------------


def run(argv: list[str], cwd: str = "/") -> str:
    return subprocess.run(argv, capture_output=True, text=True, timeout=20, cwd=cwd).stdout


def test_the_script_runs_with_the_interpreter_of_its_hash_bang_and_its_own_name_as_dollar_zero():
    t = read("--gres=gpu:1", body='echo "$0 ran"\n')
    assert t.job["command"][:2] == ["/bin/bash", "-c"] and run(t.job["command"]) == "job.sh ran\n"
    t = read("--ntasks=1", shebang="#!/usr/bin/env python3", body="print('python ran')\n")
    assert run(t.job["command"]) == "python ran\n"


def test_a_script_without_hash_bang_runs_with_bash_and_says_so():
    t = from_sbatch("#SBATCH --gres=gpu:1\necho hi\n", "x.sh")
    assert t.job["command"][0] == "bash" and any("no #! line" in w for w in t.warnings)


def test_chdir_runs_the_script_in_that_directory_and_a_relative_one_is_refused(tmp_path):
    t = read(f"--chdir={tmp_path}", body="pwd\n")
    assert run(t.job["command"]) == f"{tmp_path}\n"
    assert "absolute path" in refusal("-D runs/1")


def test_export_sets_the_variables_it_names(monkeypatch):
    t = read("--export=NONE,EPOCHS=3,WANDB_MODE", ctx=Context(environ={"WANDB_MODE": "offline"}))
    assert t.job["env"] == {"EPOCHS": "3", "WANDB_MODE": "offline"}


def test_the_job_name_is_made_a_valid_name_and_defaults_to_the_file_name():
    assert job("-J 'résumé: run #1'  # a quoted # is no comment").name == "r-sum-run-1"
    assert JobRequest.model_validate(from_sbatch("#!/bin/bash\necho\n", "train_v2.sbatch").job).name == "train_v2.sbatch"
