# Sourced by A/B call scripts (`. bin/ab-arms.sh`): the option sets that the A/B commands in docs/RESULTS.md
# name, so that a quoted command runs as it ran. tests/run/test_ab_arms.py checks that every set still resolves,
# and that the archived base runs the grids are seeded with still match their arms under today's defaults (a
# changed default would stop a seeded grid on the GPU host, numbarl ab's config.json check).
# TF32 single-switch A/Bs. Since the twentieth session TF32 pads the advantage head by default (agent.head_pad=0 ->
# 64): the same math in other GEMM kernels, other bits. The TF32 bases archived before it ran unpadded, and numbarl
# ab compares a saved config without head_pad as head_pad = 1 (config.LEGACY), so the A/B sets keep the unpadded
# head: the bases stay valid, at ~0.4 ms more per TF32 train step (1.64 against the padded and fused default's 1.22
# ms since the twenty-first session; on the unpadded head agent.head_fuse_value does nothing).
# Since the twenty-fifth session the default preset deploys a fold only when its validation trade t reaches 2
# (train.deploy_min_trade_t) and fp32's automatic head is padded and fused (agent.head_pad_fp32 = 64). The bases ran
# with the rule off (it changes no training bit: numbarl ab --deploy-min-trade-t 2 rescores them exactly), so the
# A/B sets keep it off as their bases had it, and the fp32 bases name their unpadded head: OLD32.
T="--set agent.compute=tf32 --set agent.head_pad=1 --set train.deploy_min_trade_t=0"
OLD32="--set agent.head_pad=1 --set train.deploy_min_trade_t=0"   # the fp32 default before the twenty-fifth session
# the 100-session regime walk in the presets' own precision (fp32); $RW is it in TF32 (the single-switch A/Bs)
RW32="--set data.synth_mode=regime_walk --set data.synth_sessions=100 --set train.train_sessions=94"
RW="$RW32 $T"
RWK="--set data.synth_mode=regime_walk --set data.synth_sessions=1000 --set train.train_sessions=994 $T"
TEMP16="--set agent.temporal=mamba --set agent.temporal_steps=16 --set agent.temporal_lr=5e-4"
LAG10="--set agent.temporal_conv=4 --set data.features=default,trade_imb_prev"   # + scan: issue 15's agent
# future-feature regression's term (+ agent.future_weight). Keep the arms quoted ("rwlff: $A $FF ..."): expanded
# unquoted, the * is a file pattern
FF="--set agent.future_targets=trade_imb_prev*ret_1"
# issue 15's temporal agent as the "temporal" preset holds it (twenty-second session: the scan at K = 12 without the
# convolution, the flow feature, the regression and early stopping; `--preset temporal` = the default preset + $MEM
# + train.deploy_min_trade_t=2, which trains the same bits: tests/run/test_ab_arms.py checks it). On the regime walk:
# "rws12ffes: $RW $MEM"
MEM="--set agent.temporal=mamba --set agent.temporal_steps=12 --set agent.temporal_lr=5e-4 \
--set data.features=default,trade_imb_prev $FF --set agent.future_weight=0.1 --set train.early_stop_patience=2"
# "--preset temporal" in an arm's options replaces numbarl ab's --preset default (the last --preset wins), so
# "pt32: $PT $RW32" trains what `numbarl-train --preset temporal` trains, the deployment rule included (twenty-fourth
# session)
PT="--preset temporal"
# null twins on a null market per seed (numbarl ab replaces {seed}): independent test paths instead of one
NM="--set data.synth_null=true --set data.synth_seed=10{seed}"
LAG="$LAG10 --epochs 5"                                                          # the ninth/tenth sessions' 5 epochs
ALL="$T --set agent.iqn=true --set agent.risk_budget=true --set agent.iql=true --set agent.cql_alpha=0.1 \
--set agent.confidence_weight=0.5 --set agent.confidence_floor=0.55 --set agent.spectral_norm=trunk.fc0,head.value \
--set agent.horizons=1,3,20 --set agent.cvar_alpha=0.1 --set agent.cvar_floor=0.005 --set agent.ensemble_heads=3 \
--set agent.epistemic_theta=0.0046 --set env.kelly_lambda=0.5 --set env.dsr_reward_scale=0.01"   # issue 14 all on
# archived finished runs of the bases (SEED_RUNS of bin/gpu-ab): e10 / e10null ($OLD32, the fp32 default until the
# twenty-fourth session), t32b ($T), rw ($RW),
# rwl10 ($RW $TEMP16 $LAG10), all14x ($ALL); rwlp / rwl10null (twentieth session, agent.head_pad=1 in config.json);
# rwlff / rwlff1 (twenty-first: rwl10 + $FF at agent.future_weight 0.1 / 1); twenty-second: rws12ffes ($RW $MEM),
# rwsffes / rwsffesnull (K = 16, no convolution, early stop 2), plsffes (the same on the planted market),
# rwsffesnullm / rwesnullm (a null market per seed: data.synth_seed=10{seed}); twenty-third: rws12null /
# rws12nullm ($RW $MEM on the one null path / a null market per seed), pls12 ($T $MEM, planted), t32f (the padded
# and fused TF32 default: --set agent.compute=tf32 --set train.deploy_min_trade_t=0)
# twenty-fourth (fp32): pt32 / pt32nullm / pt32pl ("$PT $RW32", "$PT $RW32 $NM", "$PT": the temporal preset as
# users run it; its fp32 head is padded since the twenty-fifth, so today's arm is "$PT $RW32 --set agent.head_pad=1"), rw32
# ("$RW32 $OLD32": the memoryless default on the regime walk), f32f / f32fnull (--set train.deploy_min_trade_t=0,
# without / with --set data.synth_null=true: fp32 with the value stream fused into the padded head, which is the
# default preset's training since the twenty-fifth session: its base runs, the rule applied by rescoring)
# twenty-fifth: d25nm ("$NM": today's default, padded fp32 head and the rule, on a null market per seed) and e10nm
# ("$OLD32 $NM"), seeds 0-9 (SEEDS=0,1,2,3,4,5,6,7,8,9)
# twenty-sixth: d25 ("d25: ", today's default on the planted market) and pt25 ("$PT $RW32": the temporal preset as
# users run it, its fp32 head padded), seeds 0-4
BASE_RUNS="docs/results/2026-12-03-session15/runs-call3.tgz docs/results/2026-12-03-session16/runs-call3.tgz \
docs/results/2026-12-03-session19/runs.tgz docs/results/2026-12-03-session20/runs.tgz \
docs/results/2026-12-03-session21/runs.tgz docs/results/2026-12-03-session22/runs.tgz \
docs/results/2026-12-03-session23/runs.tgz docs/results/2026-12-04-session24/runs.tgz \
docs/results/2026-12-04-session25/runs.tgz docs/results/2026-12-04-session26/runs.tgz"
