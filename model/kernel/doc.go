// Package kernel holds kvbridge's float32 compute kernels: the batch-invariant matrix product
// behind every linear layer and attention's two products ([Linear]; [Linear.ApplyStrided] for
// rows at a stride, [Linear.SetRows] and [Linear.SetColumns] to re-pack a scratch Linear in place
// from rows or columns held elsewhere, such as the keys and values of a paged KV store; or,
// without packing, [RowDots] and [AccumulateRows] (and their bfloat16 forms) on rows read in
// place, with [Touch]), the vector helpers attention and the MLP need ([Dot], [Axpy], [Scale],
// [Add], [Softmax], [RMSNorm], [SiLUMul]), a small worker pool ([Pool], [Parallel]) and the
// machine ceilings the benchmarks quote ([PeakGFLOPS], [MemcpyGBps], [ReadGBps]).
//
// # Batch invariance
//
// Every output element of [Linear.Apply] has exactly one computation, fixed by the layer alone:
//
//	acc = 0
//	for k = 0 .. in-1: acc = fma(x[m][k], W[n][k], acc)   // one rounding per step, k ascending
//	dst[m][n] = acc
//
// (the portable build uses acc = acc + round(x·w), two roundings, for the same fixed order).
// Tiles, SIMD lanes and goroutines only decide which element is computed where and when, never
// how: the k reduction is never split, reordered or blocked, rows never interact, and partial
// tiles (fewer rows than the tile height, fewer columns than the panel width) run the same
// per-element chain as full ones. So a row's outputs are bit-identical whatever the number of
// rows, the other rows' contents, the row's position, or the goroutine partitioning; the
// single-row (decode) path is the same kernel with one row. [Linear.ApplyStrided] runs the same
// chains on rows read and written at a stride, and a Linear re-packed by [Linear.SetRows] or
// [Linear.SetColumns] holds exactly the panels [NewLinear] builds (packing only moves data), so
// neither changes a bit. [RowDots] and [AccumulateRows] run the same per-element chains on the
// unpacked rows (AccumulateRows continuing a chain across calls), so they give the bits of a
// Linear packed from those rows.
//
// Vector helpers follow the same rule: element-wise functions compute each element the same
// way wherever it sits in the slice (vector tails use the same instructions through masks or a
// padded copy), and reductions ([Dot], [Softmax], [RMSNorm]) use one fixed order that depends
// only on the length.
//
// # Goroutines
//
// A [Linear] built with [NewLinearOn] or [NewLinearFrom] runs Apply on the workers of a [Pool];
// the code that creates the pool owns it and closes it (the model does, in its Close). Pool
// workers poll briefly between calls (so back-to-back layer products do not pay for waking a
// sleeping thread) and then park. Without a pool, Apply and [Parallel] start short-lived
// goroutines that have exited when the call returns. The package itself holds no mutable state.
//
// # Implementations
//
// One implementation is chosen at program start from the CPU's features (AVX-512F, else
// AVX2+FMA, else portable Go; the purego build tag forces portable Go) and used for every shape,
// so results are reproducible within a process and across processes on the same kind of
// machine. Different implementations may differ in the last bits (the portable path does not
// fuse multiply and add).
//
// See docs/architecture.md for where the package sits among kvbridge's packages.
package kernel
