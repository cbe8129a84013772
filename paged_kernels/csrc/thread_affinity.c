/* Pin each thread of the calling thread's OpenMP team to one CPU.
 *
 * torch runs its CPU ops on the OpenMP team of the thread that calls them (libgomp keeps one pool of
 * threads per calling thread). Left to the OS, those threads migrate between cores whenever another
 * process wakes, and two of them may share one core for a while — where the one spinning at a
 * barrier waits on the one that is not running. Pinned, each stays on its core and another process
 * can only preempt it in place. Team thread i (0: the caller) goes to cpus[i]. Built by
 * paged_kernels/native.py with the other kernels, against the same libgomp as torch's (one per process).
 */
#define _GNU_SOURCE
#include <omp.h>
#include <sched.h>
#include <stdint.h>
#include <sys/syscall.h>
#include <unistd.h>

/* Returns how many of the team's `num_threads` threads were pinned; tids[i] gets thread i's kernel
 * thread id (so the caller can check the pinning from /proc). */
int pin_team(int num_threads, const int32_t *cpus, int32_t *tids)
{
    int pinned = 0;
    #pragma omp parallel num_threads(num_threads) reduction(+:pinned)
    {
        const int i = omp_get_thread_num();
        if (omp_get_num_threads() == num_threads) {
            cpu_set_t set;
            CPU_ZERO(&set);
            CPU_SET(cpus[i], &set);
            tids[i] = (int32_t)syscall(SYS_gettid);
            pinned += sched_setaffinity(0, sizeof set, &set) == 0;
        }
    }
    return pinned;
}
