def even(prompts, completions, completion_ids, **kw):
    return [sum(t % 2 == 0 for t in ids) / max(len(ids), 1) for ids in completion_ids]
