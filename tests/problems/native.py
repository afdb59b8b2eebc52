"""Hand-written C and bash problems: stdin -> expected stdout, reference and broken solutions."""

from __future__ import annotations

from tangram_celery.common.actions import TestCase

_C_HEAD = "#include <stdio.h>\n#include <stdlib.h>\n#include <string.h>\n"

# name, language, reference, broken, [(stdin, expected stdout)]
_SPECS: list[tuple[str, str, str, str, list[tuple[str, str]]]] = [
    (
        "c_sum",
        "c",
        _C_HEAD + 'int main(void){long a,b;scanf("%ld %ld",&a,&b);printf("%ld\\n",a+b);return 0;}',
        _C_HEAD + 'int main(void){long a,b;scanf("%ld %ld",&a,&b);printf("%ld\\n",a-b);return 0;}',
        [("1 2", "3"), ("-5 5", "0"), ("1000000000 1000000000", "2000000000")],
    ),
    (
        "c_max",
        "c",
        _C_HEAD + 'int main(void){int n,x,m;scanf("%d",&n);scanf("%d",&m);'
        'for(int i=1;i<n;i++){scanf("%d",&x);if(x>m)m=x;}printf("%d\\n",m);return 0;}',
        _C_HEAD + 'int main(void){int n,x,m;scanf("%d",&n);scanf("%d",&m);'
        'for(int i=1;i<n-1;i++){scanf("%d",&x);if(x>m)m=x;}printf("%d\\n",m);return 0;}',
        [("3\n1 5 2", "5"), ("1\n-4", "-4"), ("4\n1 2 3 9", "9")],
    ),
    (
        "c_reverse",
        "c",
        _C_HEAD + "int main(void){char s[1024];if(!fgets(s,sizeof s,stdin))return 1;"
        'size_t n=strcspn(s,"\\n");for(size_t i=n;i>0;i--)putchar(s[i-1]);putchar(10);return 0;}',
        _C_HEAD + "int main(void){char s[1024];if(!fgets(s,sizeof s,stdin))return 1;"
        'size_t n=strcspn(s,"\\n");for(size_t i=n;i>1;i--)putchar(s[i-1]);putchar(10);return 0;}',
        [("hello", "olleh"), ("ab", "ba"), ("racecar", "racecar")],
    ),
    (
        "c_fib",
        "c",
        _C_HEAD + 'int main(void){int n;scanf("%d",&n);long a=0,b=1;'
        'for(int i=0;i<n;i++){long t=a+b;a=b;b=t;}printf("%ld\\n",a);return 0;}',
        _C_HEAD + 'int main(void){int n;scanf("%d",&n);long a=0,b=1;'
        'for(int i=0;i<=n;i++){long t=a+b;a=b;b=t;}printf("%ld\\n",a);return 0;}',
        [("0", "0"), ("1", "1"), ("10", "55"), ("50", "12586269025")],
    ),
    (
        "c_primes",
        "c",
        _C_HEAD + 'int main(void){int n,c=0;scanf("%d",&n);for(int i=2;i<=n;i++){int p=1;'
        'for(int d=2;d*d<=i;d++)if(i%d==0){p=0;break;}c+=p;}printf("%d\\n",c);return 0;}',
        _C_HEAD + 'int main(void){int n,c=0;scanf("%d",&n);for(int i=2;i<n;i++){int p=1;'
        'for(int d=2;d*d<=i;d++)if(i%d==0){p=0;break;}c+=p;}printf("%d\\n",c);return 0;}',
        [("10", "4"), ("2", "1"), ("100", "25"), ("97", "25")],
    ),
    (
        "c_sort",
        "c",
        _C_HEAD + "static int cmp(const void*a,const void*b){return *(int*)a-*(int*)b;}"
        'int main(void){int n,v[100];scanf("%d",&n);for(int i=0;i<n;i++)scanf("%d",&v[i]);'
        'qsort(v,n,sizeof(int),cmp);for(int i=0;i<n;i++)printf("%d%c",v[i],i+1<n?32:10);return 0;}',
        _C_HEAD + "static int cmp(const void*a,const void*b){return *(int*)b-*(int*)a;}"
        'int main(void){int n,v[100];scanf("%d",&n);for(int i=0;i<n;i++)scanf("%d",&v[i]);'
        'qsort(v,n,sizeof(int),cmp);for(int i=0;i<n;i++)printf("%d%c",v[i],i+1<n?32:10);return 0;}',
        [("3\n3 1 2", "1 2 3"), ("1\n7", "7"), ("4\n-1 5 0 2", "-1 0 2 5")],
    ),
    (
        "bash_wordcount",
        "bash",
        "wc -w | tr -d ' '",
        "wc -l | tr -d ' '",
        [("a b c\n", "3"), ("one two\nthree four five\n", "5")],
    ),
    (
        "bash_upper",
        "bash",
        "tr '[:lower:]' '[:upper:]'",
        "tr '[:upper:]' '[:lower:]'",
        [("Hello World\n", "HELLO WORLD"), ("abc\n", "ABC")],
    ),
    (
        "bash_sum_lines",
        "bash",
        "s=0; while read -r x; do s=$((s + x)); done; echo $s",
        "s=0; while read -r x; do s=$((s * x)); done; echo $s",
        [("1\n2\n3\n", "6"), ("10\n-10\n", "0"), ("5\n", "5")],
    ),
    ("bash_uniq_sorted", "bash", "sort | uniq", "uniq", [("b\na\nb\n", "a\nb"), ("x\ny\nx\n", "x\ny")]),
    (
        "bash_fizzbuzz",
        "bash",
        "read n; for ((i=1;i<=n;i++)); do if ((i%15==0)); then echo FizzBuzz; elif ((i%3==0)); "
        "then echo Fizz; elif ((i%5==0)); then echo Buzz; else echo $i; fi; done",
        "read n; for ((i=1;i<=n;i++)); do if ((i%3==0)); then echo Fizz; elif ((i%5==0)); "
        "then echo Buzz; elif ((i%15==0)); then echo FizzBuzz; else echo $i; fi; done",
        [
            ("5", "1\n2\nFizz\n4\nBuzz"),
            ("15", "1\n2\nFizz\n4\nBuzz\nFizz\n7\n8\nFizz\nBuzz\n11\nFizz\n13\n14\nFizzBuzz"),
        ],
    ),
]


def native_problems() -> list:
    from tests.problems import Problem

    return [
        Problem(
            name=name,
            language=lang,
            reference=ref,
            broken=bad,
            tests=[
                TestCase(name=f"{name}_{i}", stdin=inp, expected_stdout=out)
                for i, (inp, out) in enumerate(cases)
            ],
        )
        for name, lang, ref, bad, cases in _SPECS
    ]
