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
					case g == 2 && bf16:
						rowDotsBF16p512g2(&args, n, dim, rows, dim, dim, &tmp[0])
					case g == 2:
						rowDots512g2(&args, n, dim, rows, dim, dim, &tmp[0])
					case bf16:
						rowDotsBF16p512g4(&args, n, dim, rows, dim, dim, &tmp[0])
					default:
						rowDots512g4(&args, n, dim, rows, dim, dim, &tmp[0])
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
