package xferbench

import (
	"context"
	"encoding/binary"
	"io"
	"net"
	"time"
)

// fillPattern writes the benchmark's deterministic pattern (a function of seed and offset).
func fillPattern(b []byte, seed uint64) {
	for i := 0; i+8 <= len(b); i += 8 {
		binary.LittleEndian.PutUint64(b[i:], seed^(uint64(i)*0x9e3779b97f4a7c15))
	}
}

// memcpyGBps is the SHM ceiling: one thread copying the same blocks, in the same scattered
// order, between two arenas of this process.
func memcpyGBps(dst, src []byte, block int64, didx, sidx []int, iters int) float64 {
	one := func() {
		for k, d := range didx {
			s := sidx[k]
			copy(dst[int64(d)*block:int64(d+1)*block], src[int64(s)*block:int64(s+1)*block])
		}
	}
	one() // warm
	start := time.Now()
	for range iters {
		one()
	}
	el := time.Since(start)
	return float64(block) * float64(len(didx)) * float64(iters) / el.Seconds() / 1e9
}

// tcpStreamGBps is the TCP ceiling: the best of three runs of tcpStreamOnce.
func tcpStreamGBps(ctx context.Context, block int64) (float64, error) {
	best := 0.0
	for range 3 {
		g, err := tcpStreamOnce(ctx, block)
		if err != nil {
			return 0, err
		}
		best = max(best, g)
	}
	return best, nil
}

// tcpStreamOnce measures one raw Go loopback TCP connection, one goroutine writing chunks of
// the block size (at most 4 MiB) and one reading them, for ~0.15 s.
func tcpStreamOnce(ctx context.Context, block int64) (float64, error) {
	chunk := min(block, 4<<20)
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return 0, err
	}
	defer ln.Close()
	type result struct {
		n   int64
		el  time.Duration
		err error
	}
	res := make(chan result, 1)
	go func() {
		c, err := ln.Accept()
		if err != nil {
			res <- result{err: err}
			return
		}
		defer c.Close()
		buf := make([]byte, chunk)
		var n int64
		var start time.Time
		for {
			m, err := io.ReadFull(c, buf)
			if start.IsZero() {
				start = time.Now()
			}
			n += int64(m)
			if err != nil {
				res <- result{n: n - int64(m), el: time.Since(start)}
				return
			}
		}
	}()
	var d net.Dialer
	c, err := d.DialContext(ctx, "tcp", ln.Addr().String())
	if err != nil {
		return 0, err
	}
	buf := make([]byte, chunk)
	for i := range buf {
		buf[i] = byte(i)
	}
	end := time.Now().Add(150 * time.Millisecond)
	for time.Now().Before(end) && ctx.Err() == nil {
		for range 16 {
			if _, err := c.Write(buf); err != nil {
				c.Close()
				return 0, err
			}
		}
	}
	c.Close()
	r := <-res
	if r.err != nil {
		return 0, r.err
	}
	return float64(r.n) / r.el.Seconds() / 1e9, nil
}

// tcpSameBytesGBps is the TCP ceiling of a row: one raw Go loopback TCP connection moving the
// row's very bytes — the writer sends each source block with one write, in the row's
// scattered order, and the reader reads each into its destination block — so memory and
// cache behave as in the transfer. iters repetitions are timed.
func tcpSameBytesGBps(ctx context.Context, dst, src []byte, block int64, didx, sidx []int, iters int) (float64, error) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return 0, err
	}
	defer ln.Close()
	res := make(chan error, 1)
	go func() {
		c, err := ln.Accept()
		if err != nil {
			res <- err
			return
		}
		defer c.Close()
		for range iters {
			for _, d := range didx {
				if _, err := io.ReadFull(c, dst[int64(d)*block:int64(d+1)*block]); err != nil {
					res <- err
					return
				}
			}
		}
		res <- nil
	}()
	var d net.Dialer
	c, err := d.DialContext(ctx, "tcp", ln.Addr().String())
	if err != nil {
		return 0, err
	}
	defer c.Close()
	start := time.Now()
	for range iters {
		for _, s := range sidx {
			if _, err := c.Write(src[int64(s)*block : int64(s+1)*block]); err != nil {
				return 0, err
			}
		}
	}
	if err := <-res; err != nil {
		return 0, err
	}
	el := time.Since(start)
	return float64(block) * float64(len(didx)) * float64(iters) / el.Seconds() / 1e9, nil
}
