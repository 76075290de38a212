package soak

import (
	"context"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"time"

	"github.com/kvbridge/kvbridge/faultproxy"
	"github.com/kvbridge/kvbridge/stack"
)

// injector applies one fault after another, at seeded random times, until its context ends.
// Faults with a duration are undone before the next one starts.
type injector struct {
	log   *slog.Logger
	s     *rig
	rep   *Report
	rng   *rand.Rand
	kinds []string
	mean  time.Duration
}

func newInjector(s *rig, rep *Report, cfg Config) *injector {
	return &injector{log: cfg.Logger, s: s, rep: rep, rng: rand.New(rand.NewPCG(uint64(cfg.Seed), 0xfa017)), kinds: cfg.Faults, mean: cfg.FaultInterval}
}

// between returns a duration drawn uniformly in [lo, hi).
func (in *injector) between(lo, hi time.Duration) time.Duration {
	return lo + time.Duration(in.rng.Int64N(int64(hi-lo)))
}

// lasting returns how long a fault lasts: from a quarter of the mean interval to one and a half
// times it, at most 3 s (a stall stays well within the handshake's 10 s and the load's 60 s
// deadlines, so it delays requests; the proxy's 5 s idle timeout may still fail some).
func (in *injector) lasting() time.Duration {
	lo, hi := in.mean/4, in.mean*3/2
	hi = min(hi, 3*time.Second)
	lo = min(lo, hi/2)
	return in.between(lo, hi)
}

func (in *injector) run(ctx context.Context) {
	defer in.s.resetFaults()
	if len(in.kinds) == 0 {
		<-ctx.Done()
		return
	}
	for {
		wait := time.Duration(in.rng.ExpFloat64() * float64(in.mean))
		if !sleep(ctx, wait) {
			return
		}
		in.inject(ctx)
	}
}

// sleep waits d or until ctx ends; it reports whether d passed.
func sleep(ctx context.Context, d time.Duration) bool {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
		return false
	case <-t.C:
		return true
	}
}

// inject applies one random fault (and undoes it, for those that last).
func (in *injector) inject(ctx context.Context) {
	kind := in.kinds[in.rng.IntN(len(in.kinds))]
	paths := in.s.paths()
	p := paths[in.rng.IntN(len(paths))]
	dir := []faultproxy.Direction{faultproxy.Up, faultproxy.Down, faultproxy.Both}[in.rng.IntN(3)]
	label := fmt.Sprintf("%s %s", kind, p.name)
	if kind == FaultRestart {
		label = ""
	} else {
		in.log.Warn("soak: fault", "kind", kind, "path", p.name, "direction", dir.String())
	}
	switch kind {
	case FaultLatency:
		p.fp.SetLatency(dir, in.between(5*time.Millisecond, 150*time.Millisecond))
		sleep(ctx, in.lasting())
		p.fp.SetLatency(dir, 0)
	case FaultStall:
		p.fp.Stall(dir)
		sleep(ctx, in.lasting())
		p.fp.Resume(dir)
	case FaultCut:
		p.fp.Cut()
	case FaultCloseAfter:
		p.fp.CloseAfter(dir, in.rng.Int64N(8192))
		sleep(ctx, in.lasting())
		p.fp.Reset() // disarm it if nothing came
	case FaultRefuse:
		p.fp.Refuse(true)
		sleep(ctx, in.lasting())
		p.fp.Refuse(false)
	case FaultRestart:
		e := []*stack.Engine{in.s.P, in.s.D}[in.rng.IntN(2)]
		label = fmt.Sprintf("%s %s", kind, e.Name)
		in.log.Warn("soak: fault", "kind", kind, "engine_name", e.Name)
		start := time.Now()
		if err := in.s.restart(context.WithoutCancel(ctx), e); err != nil {
			in.rep.countError("restart failed: " + err.Error())
		}
		in.log.Warn("soak: restarted", "engine_name", e.Name, "took", time.Since(start).String())
	}
	in.rep.countFault(kind, label)
}
