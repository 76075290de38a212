//go:build linux && amd64 && !purego

package kernel

import (
	"fmt"
	"math/rand/v2"
	"runtime"
	"testing"
	"unsafe"
)

// BenchmarkRowDotsGroups compares the scores kernels per key on decode's shape (128
// dimensions, 64 keys in L1, 1, 2 or 4 query rows): the single-group kernels (4 calls of 16
// keys: g1) against the grouped ones (2 calls of 32: g2; 1 of 64: g4), alternated in bursts of
// 256 passes, each first in turn. It reports each one's thread CPU ns a key and g1 ÷ g2, g1 ÷ g4.
func BenchmarkRowDotsGroups(b *testing.B) {
	if !RowKernels(128) || defaultImpl.rowDim != 16 {
		b.Skip("no AVX-512 row kernels")
	}
	r := rand.New(rand.NewPCG(5, 6))
	const n, dim, burst = 64, 128, 256
	keys := randSlice(r, n*dim)
	keys16, _ := to16(keys, BF16)
	var tmp [rowDotsTmp]float32
	for _, bf16 := range []bool{true, false} {
		for _, rows := range []int{1, 2, 4} {
			kt := "f32"
			if bf16 {
				kt = "bf16"
			}
			q := randSlice(r, rows*dim)
			dst := make([]float32, rows*n)
			var args rowDotsGroupArgs
			pass := func(g int) {
				for j := 0; j < n; j += 16 * g {
					for i := range g {
						args.dst[i], args.q[i] = &dst[j+16*i], &q[0]
						if bf16 {
							args.k[i] = unsafe.Pointer(&keys16[(j+16*i)*dim])
						} else {
							args.k[i] = unsafe.Pointer(&keys[(j+16*i)*dim])
						}
					}
					switch {
					case g == 1 && bf16:
						rowDotsBF16p512(&dst[j], n, &q[0], dim, rows, &keys16[j*dim], dim, 16, dim, &tmp[0])
					case g == 1:
						rowDots512(&dst[j], n, &q[0], dim, rows, &keys[j*dim], dim, 16, dim, &tmp[0])
					default:
						rowDotsGroups(g, bf16, &args, n, dim, rows, dim, dim, &tmp[0])
					}
				}
			}
			b.Run(fmt.Sprintf("%s/rows%d", kt, rows), func(b *testing.B) {
				runtime.LockOSThread()
				defer runtime.UnlockOSThread()
				groups := []int{1, 2, 4}
				var cpu [3]float64
				it := 0
				for b.Loop() {
					for o := range groups {
						i := (o + it) % len(groups)
						t0 := threadCPU(b)
						for range burst {
							pass(groups[i])
						}
						cpu[i] += threadCPU(b) - t0
					}
					it++
				}
				keysRun := float64(b.N) * burst * n
				for i, g := range groups {
					b.ReportMetric(cpu[i]*1e9/keysRun, fmt.Sprintf("g%dns/key", g))
				}
				b.ReportMetric(cpu[0]/cpu[1], "g1/g2")
				b.ReportMetric(cpu[0]/cpu[2], "g1/g4")
			})
		}
	}
}

// BenchmarkScoresStretches is decode attention's scores pass at batch 32, context 128, on a
// bfloat16 (or float32) KV store larger than L2 (Qwen3-0.6B's shape: 8 KV heads of 128
// dimensions, blocks of 16 tokens, 2 query rows a KV head): per sequence and block, the block's
// keys of all heads read in order (Touch, as the model does), then the 8 heads' scores — one
// RowDots(BF16) call a head with the single-group kernels (g1) against one RowDots(BF16)Set
// call with the grouped ones as exported (gN: 4 groups a call for bfloat16, 2 for float32) —
// alternated pass by pass, each first in turn. It reports each one's thread CPU ms a pass and
// g1 ÷ gN.
func BenchmarkScoresStretches(b *testing.B) {
	if !RowKernels(128) || defaultImpl.rowDim != 16 {
		b.Skip("no AVX-512 row kernels")
	}
	const seqs, blocks, heads, bs, dim, rows = 32, 8, 8, 16, 128, 2
	const stride = heads * dim // a token's keys of all heads
	r := rand.New(rand.NewPCG(7, 8))
	keys := randSlice(r, seqs*blocks*bs*stride)
	keys16, _ := to16(keys, BF16)
	q := randSlice(r, seqs*heads*rows*dim)
	scores := make([]float32, seqs*heads*rows*blocks*bs)
	ldd := blocks * bs
	ks, ks16 := make([][]float32, heads), make([][]uint16, heads)
	qs, dsts := make([][]float32, heads), make([][]float32, heads)
	for _, bf16 := range []bool{true, false} {
		name := "f32"
		if bf16 {
			name = "bf16"
		}
		pass := func(most int) float64 {
			t0 := threadCPU(b)
			for s := range seqs {
				for blk := range blocks {
					o := (s*blocks + blk) * bs * stride
					if bf16 {
						Touch(keys16[o : o+bs*stride])
					} else {
						Touch(keys[o : o+bs*stride])
					}
					for h := range heads {
						ks[h], ks16[h] = keys[o+h*dim:], keys16[o+h*dim:]
						qs[h] = q[(s*heads+h)*rows*dim:]
						dsts[h] = scores[(s*heads+h)*rows*ldd+blk*bs:]
					}
					switch {
					case most > 1 && bf16:
						RowDotsBF16Set(dsts, ldd, qs, dim, rows, ks16, stride, bs, dim)
					case most > 1:
						RowDotsSet(dsts, ldd, qs, dim, rows, ks, stride, bs, dim)
					default:
						for h := range heads {
							if bf16 {
								rowDotsWith(1, dsts[h], ldd, qs[h], dim, rows, ks16[h], stride, bs, dim)
							} else {
								rowDotsWith(1, dsts[h], ldd, qs[h], dim, rows, ks[h], stride, bs, dim)
							}
						}
					}
				}
			}
			return threadCPU(b) - t0
		}
		b.Run(name, func(b *testing.B) {
			runtime.LockOSThread()
			defer runtime.UnlockOSThread()
			pass(1)
			pass(4)
			var cpu [2]float64
			it := 0
			for b.Loop() {
				for o := range 2 {
					i := (o + it) % 2
					cpu[i] += pass([]int{1, 4}[i])
				}
				it++
			}
			b.ReportMetric(cpu[0]*1e3/float64(b.N), "g1cpu-ms")
			b.ReportMetric(cpu[1]*1e3/float64(b.N), "gNcpu-ms")
			b.ReportMetric(cpu[0]/cpu[1], "g1/gN")
		})
	}
}
