"""The thinking budget on token ids: counting, forcing the closing tag, multi-token tags."""
from pipeline.thinking import ThinkingBudget, ThinkingTags

SINGLE = ThinkingTags((90,), (91,))
MULTI = ThinkingTags((5, 6), (7, 8, 9))


def run(budget: ThinkingBudget, model_tokens: list[int]) -> list[int]:
    """Generate: take the forced token when there is one, else the model's next token."""
    out, source = [], iter(model_tokens)
    while len(out) < 20:
        token = budget.forced_token if budget.forced_token is not None else next(source, None)
        if token is None:
            break
        budget.observe(token)
        out.append(token)
    return out


def test_budget_closes_an_open_block_with_the_end_tag():
    assert run(ThinkingBudget(SINGLE, 3, inside=True), [1, 2, 3, 4, 5, 6]) == [1, 2, 3, 91, 4, 5, 6]


def test_block_closed_by_the_model_in_time_is_left_alone():
    assert run(ThinkingBudget(SINGLE, 5, inside=True), [1, 91, 2, 3]) == [1, 91, 2, 3]


def test_block_opened_by_the_model_is_counted_from_its_tag():
    budget = ThinkingBudget(SINGLE, 2, inside=False)
    assert run(budget, [1, 90, 2, 3, 4, 5]) == [1, 90, 2, 3, 91, 4, 5]
    assert not budget.inside and budget.used == 2


def test_multi_token_tags_are_forced_whole():
    assert run(ThinkingBudget(MULTI, 2, inside=False), [5, 6, 1, 2, 3]) == [5, 6, 1, 2, 7, 8, 9, 3]


def test_zero_budget_closes_at_once():
    assert run(ThinkingBudget(SINGLE, 0, inside=True), [1, 2]) == [91, 1, 2]


def test_prompt_opening_the_block():
    assert SINGLE.prompt_opens_block([3, 90, 4])
    assert not SINGLE.prompt_opens_block([3, 90, 4, 91, 5])
    assert not SINGLE.prompt_opens_block([1, 2])
    assert MULTI.prompt_opens_block([5, 6, 1])


def test_engine_forces_the_closing_tag_when_the_budget_is_spent(tiny_model_dir):
    import asyncio

    from pipeline.engine import Engine
    from pipeline.request import SamplingParams
    from tests.conftest import run_async
    from tests.engine_utils import assert_no_leaks, collect, config_for, settle

    async def main():
        engine = await Engine.create(config_for(tiny_model_dir))
        try:
            tags = engine.loaded.limits.thinking_tags
            prompt = [100, 200] + list(tags.start_ids)  # the prompt opens the thinking block
            params = SamplingParams(max_tokens=12, temperature=0.8, seed=1, ignore_eos=True, thinking_token_budget=4)
            free = SamplingParams(max_tokens=12, temperature=0.8, seed=1, ignore_eos=True)
            budgeted, unbudgeted = await asyncio.gather(collect(engine, prompt_token_ids=prompt, params=params),
                                                        collect(engine, prompt_token_ids=prompt, params=free))
            await settle(engine)
            assert_no_leaks(engine)
            return tags, budgeted[0].token_ids, unbudgeted[0].token_ids
        finally:
            await engine.shutdown()

    tags, budgeted, unbudgeted = run_async(main())
    end = list(tags.end_ids)
    assert budgeted[:4] == unbudgeted[:4]  # the same draws until the budget runs out
    assert budgeted[4:4 + len(end)] == end
    assert len(budgeted) == 12
