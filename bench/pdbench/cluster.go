package pdbench

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"time"

	"github.com/kvbridge/kvbridge/instance"
	"github.com/kvbridge/kvbridge/model/kernel"
	"github.com/kvbridge/kvbridge/stack"
)

// cluster is the pdStack of one process: a single engine, P and D and the one-way proxy, all
// on 127.0.0.1 (package stack), with the proxy's engine legs traced.
type cluster struct {
	*stack.Stack
	tracer *tracer
	tr     *http.Transport
	last   [2]instance.Stats // P's and D's at the previous takeTransfers
}

// startCluster starts the stack. Every prompt is new, so no engine caches prefixes.
func startCluster(ctx context.Context, cfg stack.Config) (*cluster, error) {
	c := &cluster{tracer: newTracer(stack.NewTransport(4)), tr: stack.NewTransport(4)}
	cfg.Single = true
	cfg.Proxy.Transport = c.tracer
	s, err := stack.Start(ctx, cfg)
	if err != nil {
		return nil, err
	}
	c.Stack = s
	c.tracer.setPrefill(s.P.FrontAddr())
	return c, nil
}

func (c *cluster) client() *http.Client { return &http.Client{Transport: c.tr} }

func (c *cluster) urls() (single, proxy string) { return c.Single.URL(), c.URL }

func (c *cluster) legs(id string) (legTimes, bool) { return c.tracer.take(id) }

// engineCPU reports no per-engine CPU time: the engines share this process.
func (c *cluster) engineCPU() (single, p, d time.Duration, ok bool) { return 0, 0, 0, false }

// engineTTFT returns the single engine's, P's and D's summed engine-side TTFT so far.
func (c *cluster) engineTTFT(context.Context) (single, p, d time.Duration, err error) {
	var out [3]time.Duration
	for i, e := range []*stack.Engine{c.Single, c.P, c.D} {
		st, err := e.Stats()
		if err != nil {
			return 0, 0, 0, err
		}
		out[i] = st.TTFT
	}
	return out[0], out[1], out[2], nil
}

// dStepTokens returns the tokens D's forward steps computed so far.
func (c *cluster) dStepTokens(context.Context) (int64, error) {
	st, err := c.D.Stats()
	return st.StepTokens, err
}

// takeTransfers returns the KV transfers since the previous call: D's reads (pull) and P's
// writes (push).
func (c *cluster) takeTransfers(context.Context) (transfers, error) {
	var sum transfers
	for i, e := range []*stack.Engine{c.P, c.D} {
		st, err := e.Stats()
		if err != nil {
			return transfers{}, err
		}
		prev := c.last[i]
		c.last[i] = st
		sum.n += st.Transfers - prev.Transfers
		sum.failed += st.FailedTransfers - prev.FailedTransfers
		sum.dur += st.TransferTime - prev.TransferTime
		sum.bytes += st.TransferBytes - prev.TransferBytes
	}
	return sum, nil
}

// settleTimeout bounds settle: a transfer of the longest prompt ends well within it.
const settleTimeout = 30 * time.Second

// settle polls P's held requests until there are none.
func (c *cluster) settle(ctx context.Context) error {
	return pollUntil(ctx, "P to let go of the request's blocks", func() (bool, error) {
		st, err := c.P.Stats()
		return err == nil && st.Held == 0, err
	})
}

// pollUntil calls done every millisecond until it reports true, fails, or settleTimeout passes.
func pollUntil(ctx context.Context, what string, done func() (bool, error)) error {
	ctx, cancel := context.WithTimeout(ctx, settleTimeout)
	defer cancel()
	tick := time.NewTicker(time.Millisecond)
	defer tick.Stop()
	for {
		ok, err := done()
		if err != nil || ok {
			return err
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("pdbench: waiting for %s: %w", what, ctx.Err())
		case <-tick.C:
		}
	}
}

// ceiling is one goroutine's memcpy of n bytes, in GB/s.
func (c *cluster) ceiling(_ context.Context, n int64) (ceilings, error) {
	return ceilings{best: kernel.MemcpyGBps(int(n))}, nil
}

// Close stops the proxy and the engines.
func (c *cluster) Close() error {
	c.tr.CloseIdleConnections()
	return c.Stack.Close()
}

// stopServer shuts srv down (waiting up to 10 s for requests in flight) and returns what its
// Serve, which reports on served, returned besides http.ErrServerClosed.
func stopServer(srv *http.Server, served <-chan error) error {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	err := srv.Shutdown(ctx)
	if serr := <-served; !errors.Is(serr, http.ErrServerClosed) {
		err = errors.Join(err, serr)
	}
	return err
}
