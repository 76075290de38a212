package model

import (
	"context"
	"errors"
	"fmt"
	"runtime"
	"sync"
	"sync/atomic"

	"github.com/kvbridge/kvbridge/model/kernel"
)

// Tensor parallelism (OpenOptions.TensorParallelSize N).
//
// The model runs on N ranks: goroutines (each locked to an OS thread pinned to a CPU set with
// OpenOptions.RankCPUs), each with a kernel pool of its own (GOMAXPROCS/N workers, the rank's thread
// among them), which share the process's memory. Rank r owns:
//
//   - query heads [r·H/N, (r+1)·H/N) and the KV heads they read: KV heads [r·K/N, (r+1)·K/N)
//     when N divides K, else (N a multiple of K) the one KV head r·K/N, replicated on the N/K
//     ranks whose query heads need it, as vLLM does (its #19691);
//   - its KV heads' keys and values in a KV store of its own (ForwardRanks' kvs[r]): the same
//     block ids as every rank's, holding only its heads;
//   - rows of every weight matrix — each output column is computed by one rank over the whole
//     input row (the full K): its heads' rows of q, k and v, its slice of gate and up, and
//     columns of o_proj, down_proj (of the hidden size) and lm_head (of the vocabulary).
//
// A decoder layer is four phases, with a barrier (barrier.go) after each: (1) the input norm of
// every row (each rank computes it, into a buffer of its own), the rank's q, k and v, its
// tokens' KV written into its store, its heads' attention, written into its columns of the
// step's attention rows; (2) its columns of o_proj over the whole attention rows — in one
// process the all-gather is the barrier, the other ranks' columns are read where they were
// written — added into its columns of the residual; (3) the post-attention norm, its slice of
// gate and up and of SiLU(gate)·up, into its columns of the step's activation rows; (4) its
// columns of down_proj over the whole activation rows, added into the residual. The logits are
// the final norm and each rank's columns of lm_head.
//
// Why it is exact. No sum is ever split across ranks: every output element of every product is
// one kernel chain over its whole input row (kernel.Linear computes each element with a chain
// fixed by the layer's K alone, whatever the number of output columns or the column's offset
// in the matrix — see the kernel package's documentation), every norm, RoPE, softmax and
// residual add is computed as at one rank on the same values, and attention is per KV head.
// So the KV of every head and the logits are bit-identical at every N, in every precision
// (float32, bfloat16, int8 weights; float32, bfloat16, FP8 KV). What it costs: the norms are
// computed by every rank, and a replicated KV head is computed and stored by each of its ranks.
//
// Load sharing: the ranks of a memory domain help one another. A rank's columns are static, and
// with one worker a rank (two cores, two ranks) nobody else would compute them when its core is
// slower (a shared machine) or its work larger; TP 1's workers share a product's panels
// dynamically. So every rank's pool is shared (kernel.Pool.Share: its products and loops publish
// their items and split for the team's workers), and a rank waiting at the barrier, or done with
// its logits first, takes unclaimed items of the other ranks of its domain (kernel.Pool.Help)
// instead of only polling. An item is computed by the same kernel chain whoever claims it, into
// the same place, so no result changes. A domain is the set of NUMA nodes of the rank's CPU set
// (memoryDomain, pin_linux.go); unpinned ranks run anywhere and are all one domain. Ranks on
// different nodes keep their static slices: each reads only its own share of the weights and
// its own KV, for memory locality. The step's own loops (RoPE's angles, handing out the logits)
// run on its caller: a third goroutine polling beside the ranks would take turns with them.
//
// A Forward takes a group of rank goroutines (tpGroup) for the step — ranks 1…N-1, and rank 0
// too when it is pinned; an unpinned rank 0 is the goroutine that called Forward: concurrent
// Forwards (the engines of data-parallel ranks sharing the model) each get a group, started on
// first need and kept until Close.

// tpColumnAlign is the column multiple (the kernel's panel width) at which ranks' column
// slices start when every rank gets at least that many: a slice boundary inside a panel would
// make two ranks compute a partial panel each. It changes no result.
const tpColumnAlign = 64

// span is the range [lo, hi).
type span struct{ lo, hi int }

func (s span) len() int { return s.hi - s.lo }

// share is the part of every weight matrix a model packs: all of it, or a rank's.
type share struct {
	n             int  // ranks (1: the whole model)
	q, kv         span // query heads and KV heads
	hidden, inter span // output columns of o_proj and down_proj; of gate and up
	vocab         span // output columns of lm_head
}

// wholeModel is the share of a model on one rank.
func wholeModel(c Config) share {
	return share{n: 1, q: span{0, c.NumHeads}, kv: span{0, c.NumKVHeads},
		hidden: span{0, c.HiddenSize}, inter: span{0, c.IntermediateSize}, vocab: span{0, c.VocabSize}}
}

// checkTensorParallel reports whether the model can run on n ranks.
func (c Config) checkTensorParallel(n int) error {
	switch {
	case c.NumHeads%n != 0:
		return fmt.Errorf("%w: size %d does not divide the %d attention heads", ErrTensorParallel, n, c.NumHeads)
	case n <= c.NumKVHeads && c.NumKVHeads%n != 0:
		return fmt.Errorf("%w: size %d does not divide the %d KV heads (with %d attention heads)", ErrTensorParallel, n, c.NumKVHeads, c.NumHeads)
	case n > c.NumKVHeads && n%c.NumKVHeads != 0:
		return fmt.Errorf("%w: size %d is more than the %d KV heads but not a multiple of them (with %d attention heads)", ErrTensorParallel, n, c.NumKVHeads, c.NumHeads)
	}
	return nil
}

// rankShare returns rank r's share of n ranks (checkTensorParallel(n) must hold).
func (c Config) rankShare(n, r int) share {
	q := c.NumHeads / n
	sh := share{n: n, q: span{r * q, (r + 1) * q},
		hidden: columns(c.HiddenSize, n, r), inter: columns(c.IntermediateSize, n, r), vocab: columns(c.VocabSize, n, r)}
	if n <= c.NumKVHeads {
		k := c.NumKVHeads / n
		sh.kv = span{r * k, (r + 1) * k}
	} else {
		sh.kv = span{r * c.NumKVHeads / n, r*c.NumKVHeads/n + 1}
	}
	return sh
}

// columns returns rank r's slice of total output columns split over n ranks: about equal, on
// tpColumnAlign boundaries when every rank gets at least that many.
func columns(total, n, r int) span {
	at := func(r int) int {
		b := r * total / n
		if total/n >= tpColumnAlign && r > 0 && r < n {
			b = min(total, (b+tpColumnAlign/2)/tpColumnAlign*tpColumnAlign)
		}
		return b
	}
	return span{at(r), at(r + 1)}
}

// TensorParallelSize returns the number of ranks the model runs on (OpenOptions.TensorParallelSize).
func (m *Model) TensorParallelSize() int {
	if m.tp == nil {
		return 1
	}
	return len(m.tp.ranks)
}

// RankKVHeads returns the KV heads rank r holds in its KV store, [first, first+n) of the
// model's (every rank holds the same number; with more ranks than KV heads, a head is held by
// several ranks). At one rank it is every KV head.
func (m *Model) RankKVHeads(r int) (first, n int) {
	if m.tp == nil {
		return 0, m.cfg.NumKVHeads
	}
	kv := m.tp.ranks[r].share.kv
	return kv.lo, kv.len()
}

// headRow writes row t of lm_head (a tied embedding's row) into dst, from the rank that holds it.
func (m *Model) headRow(t int, dst []float32) {
	if m.tp == nil {
		m.head.Row(t, dst)
		return
	}
	for _, r := range m.tp.ranks {
		if t < r.share.vocab.hi {
			r.m.head.Row(t-r.share.vocab.lo, dst)
			return
		}
	}
	panic(fmt.Sprintf("model: token %d outside the vocabulary", t))
}

// tensorParallel is a model's ranks and the groups of goroutines that run them.
type tensorParallel struct {
	ranks []tpRank
	cpus  [][]int // OpenOptions.RankCPUs

	mu     sync.Mutex
	idle   []*tpGroup // groups no Forward is using
	all    []*tpGroup
	closed bool
}

// tpRank is one rank's shard of the model: a Model whose configuration counts the rank's heads,
// whose Linears are its share of the matrices and whose pool is its own.
type tpRank struct {
	m     *Model
	share share
}

// newTensorParallel splits m (with the weights w and lm_head's matrix head) over prec.tp ranks
// and starts the first group of rank goroutines, so that a CPU set that cannot be applied fails
// the load.
func newTensorParallel(m *Model, w *weights, head matrix, prec precision) (*tensorParallel, error) {
	c, n := m.cfg, prec.tp
	if err := c.checkTensorParallel(n); err != nil {
		return nil, err
	}
	tp := &tensorParallel{ranks: make([]tpRank, n), cpus: prec.rankCPUs}
	workers := max(1, runtime.GOMAXPROCS(0)/n)
	var packing sync.WaitGroup
	for r := range n {
		sh := c.rankShare(n, r)
		rc := c
		rc.NumHeads, rc.NumKVHeads = sh.q.len(), sh.kv.len()
		rm := &Model{
			name: m.name, cfg: rc, norm: m.norm, pool: kernel.NewPool(workers), serial: m.serial,
			qScale: m.qScale, prefillMin: rc.tileTokens() + 1, inPlace: m.inPlace,
			bf16: m.bf16, kvBF16: m.kvBF16, int8: m.int8, kvFP8: m.kvFP8, fp8: m.fp8, fp8Layers: m.fp8Layers,
			attnCol: sh.q.lo * c.HeadDim, attnWidth: c.NumHeads * c.HeadDim,
		}
		tp.ranks[r] = tpRank{m: rm, share: sh}
		packing.Go(func() { rm.weightBytes = rm.pack(w, head, prec, sh) })
	}
	packing.Wait()
	// The step's own loops run on its caller (see the top of this file).
	if err := m.pool.Close(); err != nil {
		return nil, err
	}
	m.pool = kernel.NewPool(1)
	domains := tp.domains(0)
	for r, d := range domains {
		if team := count(domains, d); team > 1 {
			tp.ranks[r].m.pool.Share(team * workers)
		}
	}
	g, err := tp.start()
	if err != nil {
		return nil, errors.Join(err, tp.close())
	}
	tp.put(g)
	return tp, nil
}

// start starts a new group of rank goroutines.
func (tp *tensorParallel) start() (*tpGroup, error) {
	tp.mu.Lock()
	defer tp.mu.Unlock()
	if tp.closed {
		return nil, ErrClosed
	}
	n := len(tp.ranks)
	g := &tpGroup{bar: newBarrier(n), cmd: make([]chan func(int), n), done: make(chan any, n), work: make([]workspace, n),
		help: tp.helpers(tp.domains(len(tp.all)))}
	ready := make(chan error, n)
	started := 0
	for r := range n {
		cpus := tp.rankCPUs(len(tp.all), r)
		if r == 0 && len(cpus) == 0 {
			continue // rank 0 runs on the caller (see run)
		}
		g.cmd[r] = make(chan func(int), 1)
		g.exited.Add(1)
		started++
		go g.serve(r, cpus, ready)
	}
	var errs []error
	for range started {
		errs = append(errs, <-ready)
	}
	if err := errors.Join(errs...); err != nil {
		g.stop()
		return nil, err
	}
	tp.all = append(tp.all, g)
	return g, nil
}

// rankCPUs returns the CPU set of rank r in the i-th group (none: unpinned).
func (tp *tensorParallel) rankCPUs(i, r int) []int {
	if len(tp.cpus) == 0 {
		return nil
	}
	return tp.cpus[(i*len(tp.ranks)+r)%len(tp.cpus)]
}

// domains returns the memory domain (memoryDomain) of each rank of the i-th group.
func (tp *tensorParallel) domains(i int) []string {
	d := make([]string, len(tp.ranks))
	for r := range d {
		d[r] = memoryDomain(tp.rankCPUs(i, r))
	}
	return d
}

// count returns how many of ds are d.
func count(ds []string, d string) int {
	n := 0
	for _, e := range ds {
		if e == d {
			n++
		}
	}
	return n
}

// helpers returns each rank's work while it waits at the barrier (nil: none), given the ranks'
// memory domains: items of the products and loops its domain's other ranks are still running.
func (tp *tensorParallel) helpers(domains []string) []func() bool {
	help := make([]func() bool, len(tp.ranks))
	for r, d := range domains {
		var peers []*kernel.Pool
		for k := 1; k < len(domains); k++ {
			if p := (r + k) % len(domains); domains[p] == d {
				peers = append(peers, tp.ranks[p].m.pool)
			}
		}
		if len(peers) == 0 {
			continue
		}
		help[r] = func() bool {
			for _, p := range peers {
				if p.Help() {
					return true
				}
			}
			return false
		}
	}
	return help
}

// take returns an idle group, starting one if there is none.
func (tp *tensorParallel) take() (*tpGroup, error) {
	tp.mu.Lock()
	if k := len(tp.idle); k > 0 {
		g := tp.idle[k-1]
		tp.idle = tp.idle[:k-1]
		tp.mu.Unlock()
		return g, nil
	}
	tp.mu.Unlock()
	return tp.start()
}

// put gives a group back.
func (tp *tensorParallel) put(g *tpGroup) {
	tp.mu.Lock()
	defer tp.mu.Unlock()
	tp.idle = append(tp.idle, g)
}

// close stops every group's goroutines, waits for them and closes the ranks' pools. It is
// idempotent; no Forward may be running (Model.Close holds the model's lock).
func (tp *tensorParallel) close() error {
	if tp == nil {
		return nil
	}
	tp.mu.Lock()
	all := tp.all
	if tp.closed {
		all = nil
	}
	tp.closed = true
	tp.mu.Unlock()
	for _, g := range all {
		g.stop()
	}
	var errs []error
	for _, r := range tp.ranks {
		errs = append(errs, r.m.pool.Close())
	}
	return errors.Join(errs...)
}

// tpGroup is one set of rank goroutines, which runs one Forward at a time.
type tpGroup struct {
	bar    *barrier
	cmd    []chan func(r int) // rank r's work; closed to stop it (nil for rank 0 run by the caller)
	done   chan any           // one value per rank and command: nil, or what its work panicked with
	halt   atomic.Bool        // rank 0 saw the step's context end: every rank stops after the layer
	work   []workspace        // each rank's buffers
	help   []func() bool      // rank r's work while it waits at the barrier (nil: none; helpers)
	exited sync.WaitGroup
}

// wait is rank r's wait at the group's barrier, helping the ranks of its memory domain.
func (g *tpGroup) wait(r int) bool {
	return g.bar.wait(g.help[r])
}

// stop ends the group's goroutines and waits for them.
func (g *tpGroup) stop() {
	for _, c := range g.cmd {
		if c != nil {
			close(c)
		}
	}
	g.exited.Wait()
}

// serve is rank r's goroutine (on an OS thread of its own pinned to cpus, if any): it runs the
// group's commands until its channel is closed. It reports on ready once, whether the thread
// could be pinned.
func (g *tpGroup) serve(r int, cpus []int, ready chan<- error) {
	defer g.exited.Done()
	var err error
	if len(cpus) > 0 {
		// The thread stays locked until the goroutine exits, so a pinned thread is not handed
		// back to the runtime's other goroutines: it ends with the goroutine. An unpinned rank
		// is a plain goroutine (waking a locked thread costs more than any goroutine's wake-up).
		runtime.LockOSThread()
		if err = pinThread(cpus); err != nil {
			err = fmt.Errorf("%w: rank %d: pin to CPUs %v: %w", ErrTensorParallel, r, cpus, err)
		}
	}
	ready <- err
	for {
		fn, ok := receive(g.cmd[r])
		if !ok {
			return
		}
		g.done <- g.do(r, fn)
	}
}

// do runs fn for rank r and returns what it panicked with; a panic breaks the barrier, so the
// other ranks stop at their next wait instead of waiting for this one.
func (g *tpGroup) do(r int, fn func(r int)) (p any) {
	defer func() {
		if p = recover(); p != nil {
			g.bar.breakAll()
		}
	}()
	fn(r)
	return nil
}

// run runs fn on every rank and returns when all have returned; a rank's panic is raised again
// here (ForwardRanks turns it into an error). An unpinned rank 0 runs on the calling goroutine,
// which would otherwise only wait: N goroutines compute a step on N ranks, not N + 1.
func (g *tpGroup) run(fn func(r int)) {
	g.bar.reset()
	g.halt.Store(false)
	ranks := 0
	for _, c := range g.cmd {
		if c != nil {
			c <- fn
			ranks++
		}
	}
	var first any
	if g.cmd[0] == nil {
		first = g.do(0, fn)
	}
	for range ranks {
		if p, _ := receive(g.done); p != nil && first == nil {
			first = p
		}
	}
	if first != nil {
		panic(first)
	}
}

// forward runs a step (m's shared buffers in w, filled by embedStep) on a group of ranks.
func (tp *tensorParallel) forward(ctx context.Context, m *Model, w *workspace, kvs []KVBlocks, blockSize int, seqs []Seq, total int) error {
	g, err := tp.take()
	if err != nil {
		return err
	}
	defer tp.put(g)
	c := m.cfg
	w.attn = grow(w.attn, total*c.NumHeads*c.HeadDim)
	w.act = grow(w.act, total*c.IntermediateSize)
	g.run(func(r int) { tp.ranks[r].layers(ctx, g, r, w, kvs[r], blockSize, seqs, total) })
	if err := ctx.Err(); err != nil {
		return err
	}
	h, v := c.HiddenSize, c.VocabSize
	m.logitsStep(w, seqs, func(rows []logitRow, logits []float32) {
		g.run(func(r int) {
			rk, rw := &tp.ranks[r], &g.work[r]
			rw.h = grow(rw.h, len(rows)*h)
			m.normRows(rw.h, w.x, rows)
			rk.m.head.ApplyStrided(logits[rk.share.vocab.lo:], v, rw.h, h, len(rows))
			g.wait(r) // a rank done first helps the others with theirs
		})
	})
	return nil
}

// layers runs every decoder layer of a step on rank r of group g. w holds the step's shared
// rows (the residual x, the attention and activation rows); kv is the rank's KV store.
func (rk *tpRank) layers(ctx context.Context, g *tpGroup, r int, w *workspace, kv KVBlocks, blockSize int, seqs []Seq, total int) {
	m, rw := rk.m, &g.work[r]
	c := m.cfg
	h, hw, iw := c.HiddenSize, rk.share.hidden.len(), rk.share.inter.len()
	rw.tokSeq, rw.tokPos, rw.rope, rw.attn = w.tokSeq, w.tokPos, w.rope, w.attn
	rw.h = grow(rw.h, total*h)
	rw.qkv = grow(rw.qkv, total*(c.NumHeads+2*c.NumKVHeads)*c.HeadDim)
	rw.proj = grow(rw.proj, total*hw)
	rw.gu = grow(rw.gu, total*2*iw)
	m.planViews(rw, seqs, blockSize)
	m.planAttention(rw, seqs)
	defer func() {
		rw.release()
		rw.tokSeq, rw.tokPos, rw.rope, rw.attn = nil, nil, nil, nil
	}()
	for l := range m.layer {
		m.resolveViews(rw, kv, l, blockSize, seqs)
		if !rk.layer(g, r, w, rw, &m.layer[l], seqs, blockSize, total) {
			return
		}
		if r == 0 && ctx.Err() != nil {
			g.halt.Store(true)
		}
		// Phase 4's barrier: the residual is whole again. rank 0's verdict on the context is
		// stored before it arrives, so every rank reads the same one after.
		if !g.wait(r) || g.halt.Load() {
			return
		}
	}
}

// layer runs phases 1 to 4 of decoder layer ly on the rank (see the top of this file), without
// the last barrier; false if the barrier broke.
func (rk *tpRank) layer(g *tpGroup, rank int, w, rw *workspace, ly *decoderLayer, seqs []Seq, blockSize, total int) bool {
	m := rk.m
	c := m.cfg
	h, in, qd := c.HiddenSize, c.IntermediateSize, m.attnWidth
	hid, inter := rk.share.hidden, rk.share.inter
	hw, iw := hid.len(), inter.len()
	eps := float32(c.RMSNormEps)

	// 1: attention of the rank's heads into its columns of w.attn.
	m.eachRows(total, h, func(r0, r1 int) { kernel.RMSNorm(rw.h[r0*h:r1*h], w.x[r0*h:r1*h], ly.inNorm, eps) })
	ly.qkv.Apply(rw.qkv, rw.h, total)
	m.pool.Parallel(total, func(r int) { m.prepareToken(rw, ly, seqs, blockSize, r) })
	m.attention(rw, seqs, blockSize)
	if !g.wait(rank) {
		return false
	}
	// 2: o_proj's columns over whole attention rows, into the residual's columns.
	ly.o.Apply(rw.proj, w.attn[:total*qd], total)
	m.addColumns(w.x, h, hid.lo, rw.proj, hw, total)
	if !g.wait(rank) {
		return false
	}
	// 3: the rank's slice of the MLP's activations.
	m.eachRows(total, h, func(r0, r1 int) { kernel.RMSNorm(rw.h[r0*h:r1*h], w.x[r0*h:r1*h], ly.postNorm, eps) })
	ly.gateUp.Apply(rw.gu, rw.h, total)
	m.eachRows(total, iw, func(r0, r1 int) {
		for r := r0; r < r1; r++ {
			g := rw.gu[r*2*iw : (r+1)*2*iw]
			kernel.SiLUMul(w.act[r*in+inter.lo:r*in+inter.hi], g[:iw], g[iw:])
		}
	})
	if !g.wait(rank) {
		return false
	}
	// 4: down_proj's columns over whole activation rows, into the residual's columns.
	ly.down.Apply(rw.proj, w.act[:total*in], total)
	m.addColumns(w.x, h, hid.lo, rw.proj, hw, total)
	return true
}

// addColumns adds the rows of src (width values each) into columns [col, col+width) of the
// rows of dst (ld values each): the same element-wise kernel.Add as the whole rows'.
func (m *Model) addColumns(dst []float32, ld, col int, src []float32, width, rows int) {
	m.eachRows(rows, width, func(r0, r1 int) {
		for r := r0; r < r1; r++ {
			d := dst[r*ld+col : r*ld+col+width]
			kernel.Add(d, d, src[r*width:(r+1)*width])
		}
	})
}
