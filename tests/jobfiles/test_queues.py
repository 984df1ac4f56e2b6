"""Queue manifests of KAI, Kueue and Volcano as gpuorch queues, one rule per test."""

from __future__ import annotations

from typing import Any

import pytest
import yaml

from services.jobfiles import Context, JobFileError, load_text
from shared.model import QueueSpec


def kai(name: str, parent: str | None = None, **gpu: Any) -> dict[str, Any]:
    spec: dict[str, Any] = {"resources": {"gpu": gpu}}
    if parent:
        spec["parentQueue"] = parent
    return {"apiVersion": "scheduling.run.ai/v2", "kind": "Queue", "metadata": {"name": name}, "spec": spec}


def cluster_queue(name: str, nominal: int, cohort: str | None = None, borrowing: int | None = None,
                  **spec: Any) -> dict[str, Any]:
    res: dict[str, Any] = {"name": "nvidia.com/gpu", "nominalQuota": nominal}
    if borrowing is not None:
        res["borrowingLimit"] = borrowing
    body = {"resourceGroups": [{"coveredResources": ["nvidia.com/gpu"],
                                "flavors": [{"name": "default", "resources": [res]}]}], **spec}
    if cohort:
        body["cohort"] = cohort
    return {"apiVersion": "kueue.x-k8s.io/v1beta1", "kind": "ClusterQueue", "metadata": {"name": name}, "spec": body}


def queues(*docs: dict[str, Any], ctx: Context = Context()) -> dict[str, dict[str, Any]]:
    out = {q.path: q.spec for q in load_text(yaml.safe_dump_all(docs), "q.yaml", ctx).queues}
    for spec in out.values():
        QueueSpec.model_validate(spec)
    return out


def test_a_kai_parent_queue_makes_the_dotted_path_and_quota_limit_and_weight_carry_over():
    assert queues(kai("research", quota=8, limit=16), kai("nlp", "research", quota=4, limit=-1, overQuotaWeight=2)) == {
        "research": {"guaranteed": {"gpus": 8}, "limit": {"gpus": 16}},
        "research.nlp": {"guaranteed": {"gpus": 4}, "weight": 2},
    }


def test_a_kai_quota_of_minus_one_is_at_least_what_its_children_are_guaranteed():
    got = queues(kai("org", quota=-1), kai("a", "org", quota=6), kai("b", "org", quota=2))
    assert got["org"] == {"guaranteed": {"gpus": 8}}


def test_a_kai_over_quota_weight_of_zero_never_borrows():
    assert queues(kai("fixed", quota=4, overQuotaWeight=0))["fixed"] == {"guaranteed": {"gpus": 4},
                                                                          "limit": {"gpus": 4}}


def test_a_parent_is_guaranteed_at_least_its_childrens_guarantees_as_gpuorch_requires():
    got = queues(kai("org", quota=2), kai("a", "org", quota=6))
    assert got["org"]["guaranteed"] == {"gpus": 6}


def test_a_cluster_queue_in_a_cohort_sits_below_it_and_borrows_up_to_its_borrowing_limit():
    got = queues(cluster_queue("a", 8, "research", borrowing=4), cluster_queue("b", 8, "research"))
    assert got == {"research": {"guaranteed": {"gpus": 16}},
                   "research.a": {"guaranteed": {"gpus": 8}, "limit": {"gpus": 12}},
                   "research.b": {"guaranteed": {"gpus": 8}}}


def test_a_cluster_queue_without_a_cohort_never_borrows():
    assert queues(cluster_queue("solo", 4)) == {"solo": {"guaranteed": {"gpus": 4}, "limit": {"gpus": 4}}}


def test_fair_sharing_weight_is_the_weight_and_gpu_quotas_of_several_flavors_add_up():
    doc = cluster_queue("mixed", 0, "c", fairSharing={"weight": "3"})
    doc["spec"]["resourceGroups"][0]["flavors"] = [
        {"name": f, "resources": [{"name": "nvidia.com/gpu", "nominalQuota": n}]} for f, n in (("a100", 4), ("t4", 8))]
    loaded = load_text(yaml.safe_dump(doc), "q.yaml")
    assert loaded.queues[-1].spec == {"guaranteed": {"gpus": 12}, "weight": 3}
    assert any("flavors a100, t4 add up" in w for w in loaded.queues[-1].warnings)


def test_a_local_queue_is_a_leaf_below_its_cluster_queue():
    local = {"apiVersion": "kueue.x-k8s.io/v1beta1", "kind": "LocalQueue",
             "metadata": {"name": "training", "namespace": "team-a"}, "spec": {"clusterQueue": "a"}}
    got = queues(cluster_queue("a", 8, "research"), local)
    assert got["research.a.training"] == {"guaranteed": {"gpus": 0}}


def test_a_local_queue_of_a_cluster_queue_defined_before_is_found_among_the_known_queues():
    local = {"apiVersion": "kueue.x-k8s.io/v1beta1", "kind": "LocalQueue", "metadata": {"name": "training"},
             "spec": {"clusterQueue": "a"}}
    assert list(queues(local, ctx=Context(queues=("default", "research", "research.a")))) == ["research.a.training"]


def test_a_kueue_cohort_is_a_parent_of_its_own():
    cohort = {"apiVersion": "kueue.x-k8s.io/v1alpha1", "kind": "Cohort", "metadata": {"name": "research"},
              "spec": {"parentName": "org"}}
    assert list(queues(cohort, cluster_queue("a", 2, "research"))) == ["org", "org.research", "org.research.a"]


def volcano(name: str, annotations: dict[str, str] | None = None, **spec: Any) -> dict[str, Any]:
    return {"apiVersion": "scheduling.volcano.sh/v1beta1", "kind": "Queue",
            "metadata": {"name": name, "annotations": annotations or {}}, "spec": spec}


def test_a_volcano_hierarchy_annotation_is_the_path_and_its_weights_the_weights_of_each_level():
    got = queues(volcano("prod", {"volcano.sh/hierarchy": "root/eng/prod", "volcano.sh/hierarchy-weights": "1/2/8"},
                         deserved={"nvidia.com/gpu": 8}, capability={"nvidia.com/gpu": 16}))
    assert got == {"eng": {"guaranteed": {"gpus": 8}, "weight": 2},
                   "eng.prod": {"guaranteed": {"gpus": 8}, "limit": {"gpus": 16}, "weight": 8}}


def test_a_volcano_parent_field_and_guarantee_weight_and_priority_carry_over():
    got = queues(volcano("eng", weight=2), volcano("dev", parent="eng", guarantee={"resource": {"nvidia.com/gpu": 2}},
                                                   priority=5))
    assert got == {"eng": {"guaranteed": {"gpus": 2}, "weight": 2}, "eng.dev": {"guaranteed": {"gpus": 2}, "priority": 5}}


def test_parents_that_form_a_loop_are_refused():
    with pytest.raises(JobFileError, match="loop"):
        queues(kai("a", "b"), kai("b", "a"))


def test_jobs_and_queues_in_one_file_are_told_apart():
    job = {"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": "j"}, "spec": {"template": {"spec": {
        "containers": [{"name": "c", "image": "x", "command": ["true"]}]}}}}
    loaded = load_text(yaml.safe_dump_all([kai("q", quota=1), job]), "both.yaml")
    assert [q.path for q in loaded.queues] == ["q"] and [t.job["name"] for t in loaded.jobs] == ["j"]
